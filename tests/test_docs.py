"""The documents a newcomer reads: the README's and the guides' Python examples run as written, the README
stays short, the package version names the format it writes, and the spec's registry matches the code.
(The site itself is built strictly by `./run docs` in CI.)"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: pages whose ```python blocks must run as pasted (```py blocks are for other venvs: vLLM's, llama.cpp's)
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "guide").glob("*.md")),
         "docs/reduce.md"]
BLOCKS = [(page, i, b) for page in PAGES
          for i, b in enumerate(re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S))]


@pytest.mark.parametrize("page,i,code", [
    pytest.param(page, i, b, marks=[pytest.mark.slow] if "load_model" in b else [],
                 id=f"{page}-block{i}{'-smollm2' if 'load_model' in b else ''}") for page, i, b in BLOCKS])
def test_python_blocks_run_as_pasted(page, i, code, tmp_path, monkeypatch):
    """Every ```python block of the README and the guides, each in a fresh namespace and an empty directory,
    as a newcomer pastes it (the ones that load SmolLM2 are slow: marked so)."""
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{page} block {i}", "exec"), {})
    if "kvcodec.save(" in code:
        assert any(p.suffix == ".kvz" for p in tmp_path.iterdir())


def test_every_guide_has_a_tested_example_or_none_to_test():
    assert {p for p, _, _ in BLOCKS} >= {"README.md", "docs/guide/start.md", "docs/guide/store.md",
                                         "docs/guide/agent-memory.md", "docs/guide/lossy.md"}


def test_readme_is_a_map_not_a_manual():
    """Issue 50: the README stays under 150 lines; the rest lives in the docs it links to, which exist."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    for target in re.findall(r"\]\(([^)#\s]+)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), target


def test_readme_has_the_agent_memory_loop():
    loop = [b for p, _, b in BLOCKS if p == "README.md" and "memory.kvz" in b]
    assert loop and all(k in loop[0] for k in ("kvcodec.save(", "open_kvz(", ".tokens()", "generate("))


def test_the_version_names_the_format_it_writes():
    from kvcodec.container import layout as L
    from kvcodec.version import __version__

    major, minor, _patch = __version__.split(".")
    assert (int(major), int(minor)) == (L.FORMAT_VERSION_MAJOR, L.FORMAT_VERSION_MINOR)
    assert f"## {__version__}" in (ROOT / "CHANGELOG.md").read_text()


def test_registry_lists_the_implemented_ids():
    from kvcodec import registry
    from kvcodec.container import layout as L
    from kvcodec.dtypes import DTYPES

    reg = (ROOT / "spec" / "registry.md").read_text()
    for sid, name in L.SECTION_NAMES.items():
        assert re.search(rf"\| {sid if sid != 0xFFFF else '0xFFFF'} \| `{name}` \|", reg), name
    assert registry.tier_ids() == ["exact", "lossless", "lossy", "tokens"]
    for tier in registry.tier_ids():
        assert f"`{tier}`" in reg and all(f"`{c}`" in reg for c in registry.tier(tier).codec_ids)
    assert set(registry.codec_ids()) == {c for t in registry.tier_ids() for c in registry.tier(t).codec_ids}
    for d in DTYPES:
        assert f"`{d}`" in reg
