"""The model manager's bookkeeping: LRU within the budget, pins, models in use (pure logic: the
"model" a loader returns here is just its size in bytes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from jobs.errors import JobError, ModelTooLarge
from workers.models import ModelManager

MIB = 2**20


@dataclass(frozen=True)
class Ref:
    id: str
    path: Path
    kind: str = "text"


@pytest.fixture()
def manager(monkeypatch):
    monkeypatch.setattr("workers.models.params_nbytes", lambda model: model)
    monkeypatch.setattr("workers.models._free_memory", lambda: None)
    manager = ModelManager(3 * MIB, None, {"text": lambda path, float32: (MIB, None)})
    manager.plan = lambda info: (MIB, False)  # every model: 1 MiB, as stored
    return manager


@pytest.fixture()
def refs(tmp_path):
    out = []
    for name in "abcd":
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        out.append(Ref(name, tmp_path / name))
    return out


def test_pinned_model_is_never_evicted(manager, refs):
    a, b, c, d = refs
    manager.pin(a)
    manager.get(b)
    manager.get(c)
    manager.get(d)  # over the 3 MiB budget: the least recently used unpinned one (b) goes
    assert [m["id"] for m in manager.snapshot] == ["a", "c", "d"]
    assert [m["pinned"] for m in manager.snapshot] == [True, False, False]
    assert manager.unpin(a.path) is True and manager.unpin(a.path) is False


def test_a_model_in_use_is_not_unloaded(manager, refs):
    a = refs[0]
    manager.get(a)
    manager.in_use = lambda: {str(a.path)}
    with pytest.raises(JobError) as info:
        manager.unload(a.path)
    assert info.value.status == 409 and [m["id"] for m in manager.snapshot] == ["a"]
    manager.in_use = set
    assert manager.unload(a.path) is True and manager.snapshot == []


def test_each_load_is_reported_once(manager, refs):
    loaded = []
    manager.on_load = loaded.append
    manager.get(refs[0])
    manager.get(refs[0])
    assert [r.info.id for r in loaded] == ["a"]


def test_mlx_buffer_cache_is_counted_in_the_budget(manager, refs):
    """With 1 MiB of a 3 MiB budget set aside for MLX's buffer cache, two 1 MiB models fit, not three; the
    KV caches get what is left (budget - used), and a model larger than budget - cache is refused up front."""
    manager.cache_bytes = MIB
    a, b, c, _ = refs
    assert manager.used_bytes() == MIB and manager.capacity_bytes == 2 * MIB
    manager.get(a)
    manager.get(b)
    assert manager.used_bytes() == 3 * MIB
    manager.get(c)  # no room beside the cache: a goes
    assert [m["id"] for m in manager.snapshot] == ["b", "c"] and manager.used_bytes() == 3 * MIB
    manager.plan = lambda info: (int(2.5 * MIB), False)  # fits the budget, not the budget less the cache
    with pytest.raises(ModelTooLarge, match="for MLX's buffer cache"):
        manager.get(refs[3])


class Cyclic:
    """A "model" that holds a reference to itself: only the cycle collector frees it."""

    def __init__(self):
        self.me = self


def test_a_loaded_model_is_out_of_the_collectors_sight_until_it_is_dropped(monkeypatch, refs):
    """Full collections would walk every object of every resident model (62 ms with the demo text model, the
    whole worker stopped): a load freezes what is alive, and an unload collects it again, frozen or not."""
    import gc
    import weakref

    monkeypatch.setattr("workers.models.params_nbytes", lambda model: MIB)
    loaded = []
    manager = ModelManager(3 * MIB, None, {"text": lambda path, float32: (loaded.append(Cyclic()) or loaded[-1],
                                                                          None)})
    manager.plan = lambda info: (MIB, False)
    try:
        manager.get(refs[0])
        model = weakref.ref(loaded.pop())
        assert gc.get_freeze_count() > 0
        assert not any(o is model() for o in gc.get_objects())  # frozen: no generation holds it
        assert manager.unload(refs[0].path) is True
        assert model() is None  # its cycle was collected although it had been frozen
    finally:
        gc.unfreeze()  # the rest of this test process as it was
