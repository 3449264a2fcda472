"""The README's Python example runs as written; the spec's registry matches the code."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


@pytest.mark.parametrize("i", [pytest.param(i, marks=[pytest.mark.slow] if "load_model" in b else [],
                                              id=f"block{i}{'-smollm2' if 'load_model' in b else ''}")
                               for i, b in enumerate(BLOCKS)])
def test_readme_python_blocks_run_as_pasted(i, tmp_path, monkeypatch):
    """Every ```python block of the README, each in a fresh namespace and an empty directory, as a newcomer
    pastes it (the ones that load SmolLM2 are slow: marked below)."""
    code = BLOCKS[i]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"README.md block {i}", "exec"), {})
    if "kvcodec.save(" in code:
        assert any(p.suffix == ".kvz" for p in tmp_path.iterdir())


def test_readme_has_the_agent_memory_loop():
    loop = [b for b in BLOCKS if "memory.kvz" in b]
    assert loop and all(k in loop[0] for k in ("kvcodec.save(", "open_kvz(", ".tokens()", "generate("))


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
