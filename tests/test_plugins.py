"""Third-party backends found through the ``opgraph.backends`` entry-point group."""
from __future__ import annotations

import sys
import textwrap

import numpy as np

import backends
import opgraph.core.backend as registry
import opgraph


def test_entry_point_backend_is_discovered_and_runs_phase2(tmp_path, monkeypatch):
    (tmp_path / "opg_fake_plugin.py").write_text(textwrap.dedent('''
        from backends.numpy_backend import NumpyBackend

        class CountingBackend(NumpyBackend):
            name = "counting"
            runs = 0

            def compile(self, graph, memory_plan, platform):
                inner = super().compile(graph, memory_plan, platform)
                backend = type(self)

                class Counted(inner.__class__):
                    def run(self, bindings, workspace=None):
                        backend.runs += 1
                        return super().run(bindings, workspace)
                inner.__class__ = Counted
                return inner
    '''))
    dist = tmp_path / "opg_fake_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: opg-fake-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[opgraph.backends]\ncounting = opg_fake_plugin:CountingBackend\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_DISCOVERED", False)
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    monkeypatch.setattr(registry, "_INSTANCES", dict(registry._INSTANCES))

    assert "counting" in backends.names()
    assert "counting" in backends.available()
    x = np.arange(8, dtype=np.float32).reshape(1, 2, 4)
    c = lambda *v: np.float32(v)  # noqa: E731
    with opgraph.use_backend("counting"):
        y = opgraph.ops.batch_norm_elemt_backward(x, x, c(0, 0), c(1, 1), c(1, 1), c(0, 0), c(1, 1),
                                                  c(5, 5))
    assert sys.modules["opg_fake_plugin"].CountingBackend.runs == 1
    assert np.allclose(y, 0.9 * x)
