"""Images in the Engine: greedy outputs equal KimiK3ForConditionalGeneration.generate() (one image, two of different
sizes, a mixed text / image batch, an image whose tokens a prefill chunk boundary splits, a drafter), prefix keys
that hash image content (same image ⇒ hit, different image with the same token ids ⇒ miss), bad image inputs,
generate() with images, a vision tower error, prefill/decode transfer of an image prompt."""

import pytest
import torch

from k3nn import KimiK3, KimiK3ForConditionalGeneration, MultimodalConfig
from k3nn.cache.prefix import block_hashes, extra_block_keys
from k3nn.engine import Engine, EngineConfig, RequestFailedError, RequestStatus, SamplingParams
from k3nn.engine.transfer import export_request_state, import_request_state
from k3nn.layers.dspark import DraftProposal
from k3nn.multimodal import image_content_keys

CFG = MultimodalConfig.tiny()
IMG = CFG.image_token_id
SCALE = 16.0  # pixel scale at which the tiny random model's greedy tokens depend on the image
_REFS: dict = {}


@pytest.fixture(scope="module")
def mm():
    m = KimiK3ForConditionalGeneration(CFG, dtype=torch.float64, seed=0).eval()
    m.tower_calls = 0
    inner = m.image_features

    def counted(*a, **kw):
        m.tower_calls += 1
        return inner(*a, **kw)

    m.image_features = counted
    return m


def image(h, w, seed):
    """Random patches of an h×w patch grid (h·w/4 image tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(h * w, 3, 4, 4, generator=g, dtype=torch.float64) * SCALE, torch.tensor([[1, h, w]])


def images(*imgs):
    return torch.cat([px for px, _ in imgs]), torch.cat([g for _, g in imgs])


def prompt_with(n, runs, seed):
    """n random text ids (none a placeholder) with image-token runs [(start, length)]."""
    p = torch.randint(0, 240, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    for s, k in runs:
        p[s:s + k] = [IMG] * k
    return p


def ref(mm, prompt, px, grid, n):
    key = (tuple(prompt), None if px is None else tuple(image_content_keys(px, grid)), n)
    if key not in _REFS:
        out = mm.generate(torch.tensor([prompt]), px, grid, max_new_tokens=n, eos_token_id=[])
        _REFS[key] = out[0, len(prompt):].tolist()
    return _REFS[key]


class RecordingEngine(Engine):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log = []

    def _forward(self, rows, *args):
        self.log.append([(w.req.request_id, w.req.num_computed, w.num_new) for w in rows])
        return super()._forward(rows, *args)


def engine(mm, drafter=None, **kw):
    base = dict(max_num_seqs=4, num_pages=32, num_snapshots=8, max_num_batched_tokens=512)
    base.update(kw)
    return RecordingEngine(mm, EngineConfig(**base), drafter=drafter)


def run(e, prompt, px=None, grid=None, n=4, **kw):
    rid = e.add_request(prompt, max_new_tokens=n, ignore_eos=True, pixel_values=px, image_grid_thw=grid, **kw)
    list(e.stream())
    return e.requests[rid]


ONE = (prompt_with(40, [(20, 16)], 1), *image(8, 8, 1))  # one image of 16 tokens
TWO = (prompt_with(36, [(3, 6), (20, 8)], 2), *images(image(4, 6, 2), image(8, 4, 3)))  # two: 6 + 8 tokens
TEXT = (prompt_with(30, [], 7), None, None)
LAST = (prompt_with(12, [(8, 4)], 10), *image(4, 4, 4))  # the prompt ends in the image's tokens


def test_one_image_and_two_images_of_different_sizes(mm):
    e = engine(mm)
    for p, px, grid in (ONE, TWO):
        assert run(e, p, px, grid, n=3).output == ref(mm, p, px, grid, 3)
    assert e.metrics()["finished"] == 2


def test_mixed_batch_of_text_and_image_requests(mm):
    e = engine(mm)
    reqs = [TEXT, ONE, TWO, LAST]
    ids = [e.add_request(p, max_new_tokens=3, ignore_eos=True, pixel_values=px, image_grid_thw=g) for p, px, g in reqs]
    list(e.stream())
    assert any(len(f) > 1 for f in e.log)  # batched forwards
    assert [e.requests[i].output for i in ids] == [ref(mm, p, px, g, 3) for p, px, g in reqs]


def test_an_image_split_across_prefill_chunks(mm):
    """A 70-token budget cuts the prompt at 64, inside the image's tokens [56, 72)."""
    e = engine(mm, max_num_batched_tokens=70)
    px, grid = image(8, 8, 11)
    p = prompt_with(90, [(56, 16)], 11)
    r = run(e, p, px, grid, n=3)
    assert [f[0][1:] for f in e.log[:2]] == [(0, 64), (64, len(p) - 64)]  # the image's tokens in both chunks
    assert r.output == ref(mm, p, px, grid, 3)


def test_same_image_hits_and_a_different_image_with_the_same_ids_misses(mm):
    e = engine(mm)
    a, b = image(8, 8, 12), image(8, 8, 13)
    p = prompt_with(70, [(48, 16)], 12)  # the image lies in block 0; the replay snapshot sits at 64
    first = run(e, p, *a, n=3)
    assert first.hit_len == 0 and first.output == ref(mm, p, *a, 3)
    hits, calls = e.metrics()["cache_hits"], mm.tower_calls
    again = run(e, p, a[0].clone(), a[1].clone(), n=3)  # equal content, other tensors
    assert again.hit_len == 64 and e.metrics()["cache_hits"] == hits + 1
    assert again.output == first.output
    assert mm.tower_calls == calls  # every image token was in the cached prefix: the tower did not run
    other = run(e, p, *b, n=3)
    assert other.hit_len == 0 and other.kv_len == 0 and e.metrics()["cache_hits"] == hits + 1
    assert other.output == ref(mm, p, *b, 3) != first.output
    e.prefix.check_invariants()


def test_blocks_before_the_image_are_shared_with_the_same_text(mm):
    """Image in block 1: a different image still matches block 0's pages (its key has no image in it)."""
    e = engine(mm)
    a, b = image(4, 8, 14), image(4, 8, 15)
    p = prompt_with(140, [(70, 8)], 14)
    run(e, p, *a, n=1)
    r = run(e, p, *b, n=1)
    assert r.kv_len == 64 and r.hit_len == 0
    assert r.output == run(engine(mm, enable_prefix_caching=False), p, *b, n=1).output
    text_keys = e.prefix.hashes(p)
    assert r.keys[0] == text_keys[0] and r.keys[1] != text_keys[1]


def test_retained_answer_of_an_image_prompt_is_keyed_on_the_image(mm):
    """The finished request's prompt + answer is indexed (decode-state retention) under keys with the image: the
    next turn with the same image resumes past the answer, with another image it starts over."""
    e = engine(mm)
    a, b = image(4, 4, 16), image(4, 4, 17)
    p = prompt_with(125, [(10, 4)], 16)
    first = run(e, p, *a, n=5)  # feeds 129 tokens: the state at 128 is kept
    turn = p + first.output + [5, 6, 7]
    same = run(e, turn, *a, n=2)
    off = engine(mm, enable_prefix_caching=False)
    assert same.hit_len == 128 and same.output == run(off, turn, *a, n=2).output
    other = run(e, turn, *b, n=2)
    assert other.hit_len == 0 and other.output == run(off, turn, *b, n=2).output


class Oracle:
    """Proposes the reference continuation (wrong at its second draft), from the request's token ids."""

    target_layers: list[int] = []

    def __init__(self, refs):
        self.refs = refs

    def write(self, taps, positions, slots):
        pass

    def propose(self, rows, n):
        out = []
        for r in rows:
            p = next(q for q in self.refs if tuple(r.tokens[:len(q)]) == q)
            d = (self.refs[p] + [0] * (n + 1))[len(r.tokens) - len(p):][:n]
            if n > 1:
                d[1] = (d[1] + 1) % CFG.text_config.vocab_size
            out.append(d)
        return DraftProposal(torch.tensor(out), None, None)


def test_drafter_with_image_requests(mm):
    """Verify windows after an image prompt (the drafter sees token ids and the target's hidden states)."""
    p, px, grid = ONE
    want = run(engine(mm), p, px, grid, n=8).output  # the engine without drafts (== generate(): tests above)
    e = engine(mm, Oracle({tuple(p): want}), num_speculative_tokens=3)
    r = run(e, p, px, grid, n=8)
    assert r.output == want and r.spec_rounds > 0 and r.spec_accepted > 0


def test_content_keys_and_extra_block_keys():
    px, grid = images(image(4, 4, 1), image(4, 8, 2))
    k = image_content_keys(px, grid)
    assert len(k) == 2 and k[0] != k[1] and all(len(x) == 32 for x in k)
    assert k == image_content_keys(px.clone(), grid.clone())
    px2 = px.clone()
    px2[20, 0, 0, 0] += 1  # a pixel of the second image
    k2 = image_content_keys(px2, grid)
    assert k2[0] == k[0] and k2[1] != k[1]
    extra = extra_block_keys([(range(60, 70), b"A"), (range(70, 72), b"B")], 64)
    assert extra == {0: b"A", 1: b"AB"}
    toks = list(range(200))
    plain = block_hashes(toks)
    assert block_hashes(toks, extra_keys={}) == plain  # text keys are unchanged
    mixed = block_hashes(toks, extra_keys={1: b"x"})
    assert mixed[0] == plain[0] and mixed[1] != plain[1] and mixed[2] != plain[2]  # the chain carries it on
    assert block_hashes(toks, extra_keys={1: b"x"}, prev=mixed[1], start_block=2) == mixed[2:]


def test_bad_image_inputs_name_the_argument_and_queue_nothing(mm):
    e = engine(mm)
    px, grid = image(4, 4, 1)
    p = prompt_with(20, [(5, 4)], 1)
    cases = [
        (dict(pixel_values=px, image_grid_thw=torch.tensor([[1, 4, 8]])), r"image_grid_thw describes 32 patches"),
        (dict(pixel_values=px), r"pixel_values was given without image_grid_thw"),
        (dict(image_grid_thw=grid), r"image_grid_thw was given without pixel_values"),
        (dict(), r"prompt has 4 image tokens.*pixel_values / image_grid_thw give 0 images"),
        (dict(pixel_values=torch.cat([px, px]), image_grid_thw=torch.cat([grid, grid])),
         r"prompt has 4 image tokens.*2 images.*more images than image tokens"),
        (dict(pixel_values=px[:8], image_grid_thw=torch.tensor([[1, 2, 4]])),
         r"prompt has 4 image tokens.*1 images of \[2\] tokens.*fewer images"),
        (dict(pixel_values=px.long(), image_grid_thw=grid), r"pixel_values must be a floating-point tensor"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            e.add_request(p, max_new_tokens=2, **kw)
    with pytest.raises(ValueError, match="prompts\\[0\\]: prompt has 4 image tokens"):
        e.generate([p], max_new_tokens=2)
    with pytest.raises(ValueError, match="video tokens"):
        e.add_request([3, CFG.video_token_id, 4], max_new_tokens=2)
    assert not e.waiting and not e.requests


def test_images_on_text_only_models_are_refused():
    text = KimiK3(CFG.text_config, dtype=torch.float64, seed=0)
    px, grid = image(4, 4, 1)
    p = prompt_with(20, [(5, 4)], 1)
    e = Engine(text, EngineConfig(max_num_seqs=1, num_pages=4, num_snapshots=2))
    with pytest.raises(ValueError, match="pixel_values: this engine serves a text-only KimiK3"):
        e.add_request(p, pixel_values=px, image_grid_thw=grid)
    with pytest.raises(ValueError, match="image_grid_thw: this engine serves a text-only"):
        e.add_request(p, image_grid_thw=grid)
    wrapper = KimiK3ForConditionalGeneration(MultimodalConfig(CFG.text_config, None, image_token_id=IMG,
                                                               video_token_id=None), dtype=torch.float64, seed=0)
    e2 = Engine(wrapper, EngineConfig(max_num_seqs=1, num_pages=4, num_snapshots=2))
    with pytest.raises(ValueError, match="pixel_values: this model has no vision tower"):
        e2.add_request(p, pixel_values=px, image_grid_thw=grid)
    q = prompt_with(10, [], 3)
    assert e2.generate([q], max_new_tokens=2, ignore_eos=True)[0] == \
        wrapper.generate(torch.tensor([q]), max_new_tokens=2, eos_token_id=[])[0, 10:].tolist()
    assert not e.requests and len(e2.requests) == 1


def test_samples_share_one_tower_run_and_preemption_resumes_with_the_images(mm):
    p, px, grid = ONE
    e = engine(mm)
    want = ref(mm, p, px, grid, 3)
    calls = mm.tower_calls
    rid = e.add_request(p, max_new_tokens=3, ignore_eos=True, n=2, pixel_values=px, image_grid_thw=grid)
    list(e.stream())
    assert [e.requests[f"{rid}/{i}"].output for i in range(2)] == [want] * 2
    assert mm.tower_calls == calls + 1
    # a 3-page pool: the second request is preempted when both grow past 64 tokens, then recomputes prompt + output
    reqs = [(ONE[0] + prompt_with(20, [], 20), ONE[1], ONE[2]), (TWO[0] + prompt_with(22, [], 21), TWO[1], TWO[2])]
    want = [run(engine(mm), q, a, g, n=8).output for q, a, g in reqs]
    small = engine(mm, num_pages=3, max_num_seqs=2)
    ids = [small.add_request(q, max_new_tokens=8, ignore_eos=True, pixel_values=a, image_grid_thw=g)
           for q, a, g in reqs]
    list(small.stream())
    assert small.metrics()["preemptions"] > 0
    assert [small.requests[i].output for i in ids] == want


def test_generate_takes_images_per_prompt(mm):
    """generate() with one pixel_values / image_grid_thw entry per prompt (None: text) gives what add_request +
    stream give, in prompt order; entries that do not match the prompts are refused before anything is queued."""
    batch = [ONE, TEXT, TWO, LAST]
    e = engine(mm)
    ids = [e.add_request(p, max_new_tokens=3, ignore_eos=True, pixel_values=px, image_grid_thw=g) for p, px, g in batch]
    list(e.stream())
    want = [e.requests[i].output for i in ids]
    assert want == [ref(mm, p, px, g, 3) for p, px, g in batch]
    g = engine(mm)
    got = g.generate([p for p, _, _ in batch], max_new_tokens=3, ignore_eos=True,
                     pixel_values=[px for _, px, _ in batch], image_grid_thw=[gr for _, _, gr in batch])
    assert got == want
    assert any(len(f) > 1 for f in g.log)  # one batch, not one request at a time
    n = len(g.requests)
    p, px, grid = ONE
    with pytest.raises(ValueError, match=r"pixel_values has 1 entries for 2 prompts"):
        g.generate([p, p], max_new_tokens=2, pixel_values=[px], image_grid_thw=[grid, grid])
    with pytest.raises(TypeError, match=r"pixel_values must be a list with one entry"):
        g.generate([p], max_new_tokens=2, pixel_values=px, image_grid_thw=[grid])
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt has 16 image tokens.*give 0 images"):
        g.generate([p, p], max_new_tokens=2, pixel_values=[px, None], image_grid_thw=[grid, None])
    with pytest.raises(ValueError, match=r"prompts\[0\]: pixel_values was given without image_grid_thw"):
        g.generate([p], max_new_tokens=2, pixel_values=[px])
    assert len(g.requests) == n and not g.waiting


def test_a_vision_tower_error_fails_only_that_request(mm, monkeypatch):
    """The tower raises for one request's images: that request ends FAILED with the reason, its row and pages are
    freed, and the other requests of the same forward (text and image) complete as they would alone."""
    bad_px, bad_grid = image(8, 8, 30)
    bad = (prompt_with(40, [(20, 16)], 30), bad_px, bad_grid)
    inner = mm.image_features

    def tower(pixel_values, image_grid_thw, **kw):
        if pixel_values.shape == bad_px.shape and torch.equal(pixel_values, bad_px):
            raise RuntimeError("injected vision tower failure")
        return inner(pixel_values, image_grid_thw, **kw)

    monkeypatch.setattr(mm, "image_features", tower)
    e = engine(mm)
    free = e.pools.allocator.num_free
    batch = [ONE, bad, TEXT, TWO]
    ids = [e.add_request(p, max_new_tokens=3, ignore_eos=True, pixel_values=px, image_grid_thw=g) for p, px, g in batch]
    outs = {}
    for o in e.stream():
        outs.setdefault(o.request_id, []).append(o)
    r = e.requests[ids[1]]
    assert r.status == RequestStatus.FAILED and r.finish_reason == "error"
    assert r.error.startswith("vision tower: RuntimeError: injected vision tower failure")
    assert outs[ids[1]][-1].finished and outs[ids[1]][-1].finish_reason == "error"
    first = e.log[0]
    assert ids[1] not in [rid for rid, _, _ in first] and len(first) == 3  # the others ran in that forward
    assert [e.requests[i].output for i in ids[::2] + ids[3:]] == [ref(mm, p, px, g, 3) for p, px, g in (ONE, TEXT, TWO)]
    assert all(o is None for o in e.row_owner) and not e.running and not e.waiting
    e.prefix.clear()
    assert e.pools.allocator.num_free == free
    with pytest.raises(RequestFailedError, match="vision tower"):  # generate() reports it and returns the rest
        e.generate([bad[0], ONE[0]], max_new_tokens=2, pixel_values=[bad_px, ONE[1]],
                   image_grid_thw=[bad_grid, ONE[2]])


@pytest.mark.parametrize("case", ["middle", "last"])
def test_prefill_decode_transfer_of_an_image_prompt(mm, case):
    """prefill_only with images: the manifest names each image by content key, the decode side passes the same
    pixels (checked against those keys), keys the pages as the prefill side did and generates what one engine
    generates; when the prompt ends in image tokens the decode side runs the tower for its last token."""
    if case == "middle":  # 16 image tokens inside block 0
        p, (px, grid) = prompt_with(90, [(56, 16)], 41), image(8, 8, 41)
    else:  # the prompt ends in 20 image tokens that reach into block 1
        p, (px, grid) = prompt_with(140, [(120, 20)], 42), image(8, 10, 42)
    P = engine(mm)
    rid = P.add_request(p, prefill_only=True, pixel_values=px, image_grid_thw=grid)
    while P.requests[rid].status != RequestStatus.PREFILLED:
        P.step()
    state = export_request_state(P, rid)
    assert state.manifest["images"] == [{"content_key": image_content_keys(px, grid)[0].hex(),
                                         "num_tokens": 16 if case == "middle" else 20}]
    D = engine(mm)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    with pytest.raises(ValueError, match=r"prefilled with 1 image\(s\): pass the prompt's pixel_values"):
        import_request_state(D, state, params)
    other_px, other_grid = image(int(grid[0, 1]), int(grid[0, 2]), 99)
    with pytest.raises(ValueError, match="not those the state was prefilled with.*image 0 differs"):
        import_request_state(D, state, params, pixel_values=other_px, image_grid_thw=other_grid)
    assert not D.requests and all(o is None for o in D.row_owner)
    want = ref(mm, p, px, grid, 3)
    calls = mm.tower_calls
    did = import_request_state(D, state, params, pixel_values=px.clone(), image_grid_thw=grid.clone())
    list(D.stream())
    r = D.requests[did]
    assert r.output == want
    assert r.num_forwards == 1 and mm.tower_calls == calls + (case == "last")
    assert r.keys == P.requests[rid].keys and r.keys != D.prefix.hashes(p)  # keyed on the image as well
    assert state.lease.release() is True
