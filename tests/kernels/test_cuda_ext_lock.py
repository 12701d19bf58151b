"""A CUDA-extension build killed mid-way leaves torch's lock file behind; the next build removes it once stale
instead of waiting on it forever."""

import os
import time

from k3nn.kernels import cuda_ext


def test_stale_build_lock_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "k3nn_x_0123" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    assert not cuda_ext.clear_stale_build_lock("k3nn_x_0123")  # a fresh lock: a build may be running
    old = time.time() - cuda_ext.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    assert cuda_ext.clear_stale_build_lock("k3nn_x_0123") and not lock.exists()
    assert not cuda_ext.clear_stale_build_lock("absent")
