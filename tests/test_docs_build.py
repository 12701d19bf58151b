"""The documentation: the API reference site builds with ``mkdocs build --strict`` (any warning — an object that
cannot be found, a broken cross-reference, a page left out of the nav — fails it), and the README links every
guide in docs/. Needs the ``docs`` extra, which scripts/setup.sh installs (CI runs it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# page → objects whose heading must be on it (mkdocstrings renders an object as an anchor with its path)
PAGES = {
    "api/model": ["k3nn.model.KimiK3", "k3nn.model.KimiK3.forward", "k3nn.model.KimiK3.from_pretrained",
                  "k3nn.multimodal.KimiK3ForConditionalGeneration"],
    "api/config": ["k3nn.config.KimiK3Config", "k3nn.config.KimiK3Config.k3"],
    "api/generation": ["k3nn.generation.GenerationMixin.generate", "k3nn.generation_config.GenerationConfig"],
    "api/layers": ["k3nn.layers.kda.KimiDeltaAttention", "k3nn.layers.mla.MultiHeadLatentAttention",
                   "k3nn.layers.moe.MoE", "k3nn.layers.attnres.AttnResQuery"],
    "api/ops": ["k3nn.ops.kda_chunk", "k3nn.ops.mla_decode", "k3nn.ops.attnres_mix", "k3nn.ops.moe_experts"],
    "api/registry": ["k3nn.kernels.registry.backend", "k3nn.kernels.registry.available_backends",
                     "k3nn.kernels.registry.register"],
    "api/engine": ["k3nn.engine.engine.Engine", "k3nn.engine.engine.Engine.metrics",
                   "k3nn.engine.request.SamplingParams"],
    "api/spec": ["k3nn.layers.dspark.DSparkDrafter", "k3nn.layers.dspark.DSparkConfig",
                 "k3nn.spec.train.DSparkTrainer"],
    "api/utils": ["k3nn.utils.configure_threads", "k3nn.utils.resolve_device"],
}


def test_mkdocs_build_strict(tmp_path):
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as e:  # not a skip: CI must build the reference
        raise AssertionError(f"the docs extra is not installed ({e.name}): pip install -e '.[docs]' "
                             f"(scripts/setup.sh does)") from None
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                        "--site-dir", str(site)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    for page, objects in PAGES.items():
        html = (site / page / "index.html").read_text()
        ids = set(re.findall(r'id="([^"]+)"', html))
        missing = [o for o in objects if o not in ids]
        assert not missing, f"{page}: {missing} not rendered"


def test_readme_links_every_guide_and_the_project_files():
    readme = (ROOT / "README.md").read_text()
    links = set(re.findall(r"\]\(([^)#\s]+)", readme))
    guides = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md") if p.name != "index.md"}  # index: the site's home
    assert guides - links == set(), f"README.md does not link {sorted(guides - links)}"
    for f in ("LICENSE", "CHANGELOG.md", "docs/api/index.md"):
        assert f in links, f"README.md does not link {f}"
    for link in links:  # relative links resolve
        if not re.match(r"[a-z]+:", link):
            assert (ROOT / link).exists(), f"README.md links {link}, which does not exist"
