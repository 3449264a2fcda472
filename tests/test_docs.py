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
    from kvcodec.container import layout as L
    from kvcodec.container.header import DTYPES, TIERS

    reg = (ROOT / "spec" / "registry.md").read_text()
    for sid, name in L.SECTION_NAMES.items():
        assert re.search(rf"\| {sid if sid != 0xFFFF else '0xFFFF'} \| `{name}` \|", reg), name
    for tier, codecs in TIERS.items():
        assert f"`{tier}`" in reg and all(f"`{c}`" in reg for c in codecs)
    for d in DTYPES:
        assert f"`{d}`" in reg
