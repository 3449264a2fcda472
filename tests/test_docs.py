"""The README's Python example runs as written; the spec's registry matches the code."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_python_example(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert blocks
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})
    assert (tmp_path / "cache.kvz").is_file()


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
