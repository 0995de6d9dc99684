"""get_adapter: built-in names, `pkg.module:ATTR` resolution and its error messages."""
from __future__ import annotations

import sys
import textwrap

import pytest

from fsdp_conformance.adapters import BUILTIN_ADAPTERS, Adapter, get_adapter


@pytest.mark.parametrize("name", ["torch-fsdp1", "torch-fsdp2", "impl", "fairscale"])
def test_builtin_adapters_resolve_by_name_once_per_process(name):
    adapter = get_adapter(name)
    assert isinstance(adapter, Adapter)
    assert adapter.name == name
    assert get_adapter(name) is adapter
    assert name in BUILTIN_ADAPTERS


@pytest.fixture
def downstream_module(tmp_path, monkeypatch):
    """A throwaway importable module `downstream_fsdp` in a temp dir on sys.path."""
    (tmp_path / "downstream_fsdp.py").write_text(
        textwrap.dedent(
            """
            from fsdp_conformance.adapters import Adapter


            class MyAdapter(Adapter):
                name = "my-fsdp"


            class Unnamed(Adapter):
                pass


            INSTANCE = MyAdapter()
            NOT_AN_ADAPTER = 42


            def make_adapter():
                return MyAdapter()


            def make_wrong():
                return "not an adapter"


            def needs_argument(x):
                return MyAdapter()


            class holder:
                NESTED = MyAdapter()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "downstream_fsdp"
    sys.modules.pop("downstream_fsdp", None)


@pytest.mark.parametrize("attr", ["INSTANCE", "MyAdapter", "make_adapter", "holder.NESTED"])
def test_module_attr_resolves_instance_class_factory_and_dotted(downstream_module, attr):
    adapter = get_adapter(f"{downstream_module}:{attr}")
    assert type(adapter).__name__ == "MyAdapter"
    assert adapter.name == "my-fsdp"


def test_unnamed_adapter_takes_the_path_as_its_name(downstream_module):
    assert get_adapter(f"{downstream_module}:Unnamed").name == f"{downstream_module}:Unnamed"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("torch_fsdp1", (r"unknown FSDP adapter 'torch_fsdp1'.*impl, torch-fsdp1, torch-fsdp2"
                        r".*pkg\.module:ATTR")),
        ("no_such_pkg_xyz.adapters:ADAPTER", (r"cannot import module 'no_such_pkg_xyz\.adapters'"
                                             r".*PYTHONPATH")),
        ("{mod}:MISSING", r"module '{mod}' has no attribute 'MISSING'.*Define it there"),
        ("{mod}:", r"has no attribute ''"),
        ("{mod}:NOT_AN_ADAPTER", r"resolves to 42, which is not an .*Adapter"),
        ("{mod}:make_wrong", r"factory returned str, not an .*Adapter"),
        ("{mod}:needs_argument", r"calling the factory failed.*no arguments"),
    ],
)
def test_bad_names_give_clear_errors(downstream_module, name, expected):
    name = name.format(mod=downstream_module)
    with pytest.raises(ValueError, match=expected.format(mod=downstream_module)) as info:
        get_adapter(name)
    assert repr(name)[1:-1] in str(info.value) or name in str(info.value)
