"""fsdp_conformance._patching: the one monkeypatch helper."""

import threading
import types

import pytest

from fsdp_conformance import _patching


def _owner():
    module = types.ModuleType("fake_lib")
    module.__version__ = "1.2.3"
    module.func = lambda x: x + 1
    return module


def test_patch_records_target_and_versions_and_undoes():
    owner = _owner()
    original = owner.func
    record = _patching.patch_attribute(
        owner, "func", lambda f: lambda x: f(x) * 10, key="t", written_for="fake_lib 1.2.3"
    )
    try:
        assert owner.func(1) == 20
        assert record.original is original
        assert "fake_lib.func" in record.target and "written for fake_lib 1.2.3" in str(record)
        assert record in _patching.active_patches()
    finally:
        assert record.undo()
    assert owner.func is original
    assert record not in _patching.active_patches()
    assert not record.undo()  # twice: nothing to do


def test_patch_is_idempotent_per_key_and_thread_safe():
    owner = _owner()
    made = []

    def make(f):
        made.append(f)
        return lambda x: f(x) * 10

    records = []
    threads = [
        threading.Thread(target=lambda: records.append(_patching.patch_attribute(owner, "func", make, key="k")))
        for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    try:
        assert len(made) == 1 and len({id(r) for r in records}) == 1
        assert owner.func(1) == 20  # wrapped once, not eight times
    finally:
        _patching.undo_all("k")


def test_undo_refuses_when_replaced_since():
    owner = _owner()
    record = _patching.patch_attribute(owner, "func", lambda f: lambda x: 0, key="a")
    owner.func = lambda x: 5  # someone else replaced ours
    assert not record.undo()
    assert owner.func(0) == 5
    _patching._records.clear()


def test_missing_attribute_names_the_target_and_versions():
    owner = _owner()
    with pytest.raises(AttributeError, match=r"no attribute 'gone'.*written for torch 2.13.0"):
        _patching.patch_attribute(owner, "gone", lambda f: f, key="x", written_for="torch 2.13.0")
    with pytest.raises(ValueError, match="non-empty key"):
        _patching.patch_attribute(owner, "func", lambda f: f, key="")


def test_undo_restores_a_class_attribute_as_stored():
    class Owner:
        @staticmethod
        def func(x):
            return x + 1

    record = _patching.patch_attribute(Owner, "func", lambda f: staticmethod(lambda x: 0), key="s")
    assert Owner().func(1) == 0
    assert record.undo()
    # the staticmethod itself is back (``getattr`` would have given the bare function, which
    # would then bind ``self`` as an ordinary method)
    assert isinstance(vars(Owner)["func"], staticmethod) and Owner().func(1) == 2
