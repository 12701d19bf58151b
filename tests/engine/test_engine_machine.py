"""Engine bookkeeping under random add / step / abort / export sequences (hypothesis state machine).

Invariants after every operation: every latent page's reference count is exactly (index entries using it) +
(live requests holding it); snapshot slots are owned by the index or by one request's private decode state;
running rows and their owners agree; the prefix index is consistent."""

import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from k3nn import KimiK3, KimiK3Config
from k3nn.engine import Engine, EngineConfig, RequestStatus

CFG = KimiK3Config.tiny()
MODEL = None
BASES = [torch.randint(0, CFG.vocab_size, (130,), generator=torch.Generator().manual_seed(s)).tolist()
         for s in range(2)]


def model():
    global MODEL
    if MODEL is None:
        MODEL = KimiK3(CFG, dtype=torch.float32, seed=0).eval()
    return MODEL


class EngineMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.e = Engine(model(), EngineConfig(max_num_seqs=3, num_pages=12, num_snapshots=3,
                                              max_num_batched_tokens=100, mixed_forward_max_tokens=32))
        self.n = 0

    @rule(base=st.integers(0, 1), cut=st.integers(1, 130), tail=st.integers(0, 20), new=st.integers(1, 3),
          prefill_only=st.booleans())
    def add(self, base, cut, tail, new, prefill_only):
        prompt = BASES[base][:cut] + [7] * tail
        if prefill_only and len(prompt) < 2:
            return
        self.e.add_request(prompt, max_new_tokens=new, prefill_only=prefill_only)

    @rule()
    def step(self):
        self.e.step()

    @precondition(lambda self: self.e.waiting or self.e.running)
    @rule(data=st.data())
    def abort(self, data):
        live = [r for r in self.e.requests.values()
                if r.status in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREFILLED)]
        if live:
            self.e.abort(data.draw(st.sampled_from(live)).request_id)

    @rule()
    def release_exported(self):
        for r in list(self.e.requests.values()):
            if r.status == RequestStatus.PREFILLED:
                self.e.release(r.request_id)

    @invariant()
    def bookkeeping(self):
        e = self.e
        e.prefix.check_invariants()
        refs: dict[int, int] = {}
        for x in e.prefix.entries.values():
            refs[x.page] = refs.get(x.page, 0) + 1
        live = [r for r in e.requests.values() if r.status in (RequestStatus.RUNNING, RequestStatus.PREFILLED)]
        for r in live:
            for b in r.blocks:
                refs[b] = refs.get(b, 0) + 1
        alloc = e.pools.allocator
        assert all(alloc.refcount(b) == c for b, c in refs.items())
        assert alloc.num_free == alloc.num_blocks - len(refs)
        snaps = [x.snapshot for x in e.prefix.entries.values() if x.snapshot is not None]
        snaps += [r.decode_snap[1] for r in live if r.decode_snap is not None]
        snaps += [r.spare_snap for r in live if r.spare_snap is not None]  # a verify commit's next export slot
        assert len(snaps) == len(set(snaps))
        assert e.pools.snapshots.num_free == e.pools.snapshots.num_slots - len(snaps)
        for row, owner in enumerate(e.row_owner):
            assert owner is None or owner.row == row
        assert sorted(r.row for r in live) == sorted(row for row, o in enumerate(e.row_owner) if o is not None)
        for r in e.requests.values():
            if r.status in (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.FAILED,
                            RequestStatus.WAITING):
                assert r.row is None and not r.blocks
            assert 0 <= r.num_computed <= len(r.prompt) + len(r.output)
            assert len(r.output) <= r.params.max_new_tokens


EngineMachine.TestCase.settings = settings(max_examples=6, stateful_step_count=25, deadline=None)
TestEngineMachine = EngineMachine.TestCase
