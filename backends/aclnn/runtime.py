"""Run a call plan through ctypes on the CANN libraries (backend ``"aclnn"``).

The libraries are ``lib64/libascendcl.so``, ``libnnopbase.so``, ``libopapi_math.so`` and
``libopapi_nn.so`` under ``$ASCEND_HOME_PATH`` (or ``$ASCEND_TOOLKIT_HOME``), as ops-nn docs/zh/context/compile_and_run_sample.md links them.
``OPGRAPH_ACLNN_LIBS`` (``os.pathsep``-separated paths) or the ``libs`` argument replace that
list, e.g. with one stand-in library for tests.

    >>> rt = AclnnRuntime(libs=["/nonexistent/libstub.so"])
    >>> rt.availability()[0]
    False

Per run: device buffers for every user tensor (copied host → device), one workspace arena,
the aclTensors of the plan, then for each call ``GetWorkspaceSize`` → ``aclrtMalloc`` its
workspace → run; then ``aclrtSynchronizeStream``, copy the written user tensors back, destroy
and free everything.
"""
from __future__ import annotations

import ctypes
import os
from ctypes import (POINTER, byref, c_bool, c_char_p, c_double, c_float, c_int, c_int32, c_int64,
                    c_size_t, c_uint64, c_void_p)
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from opgraph.core.backend import Backend, Executable
from opgraph.core.ir import Graph
from opgraph.core.memory import MemoryPlan
from opgraph.core.platform import Platform
from .lower import lower
from .plan import CallPlan, dtype_from_acl, format_from_acl

LIB_NAMES = ("libascendcl.so", "libnnopbase.so", "libopapi_math.so", "libopapi_nn.so")
ENV_HOMES = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
ENV_LIBS = "OPGRAPH_ACLNN_LIBS"
MEMCPY_H2D, MEMCPY_D2H, MALLOC_HUGE_FIRST = 1, 2, 0


class AclnnRuntimeError(RuntimeError):
    """A runtime or aclnn call returned non-zero; the message names the call and the status."""


def find_libraries(env: Optional[Mapping[str, str]] = None) -> tuple[Optional[list[str]], list[str]]:
    """``(paths, looked_at)``: the library list to load (None if not found) and where we looked."""
    env = os.environ if env is None else env
    if env.get(ENV_LIBS):
        paths = [p for p in env[ENV_LIBS].split(os.pathsep) if p]
        return (paths if all(os.path.isfile(p) for p in paths) else None), paths
    looked: list[str] = []
    for var in ENV_HOMES:
        home = env.get(var)
        if not home:
            looked.append(f"${var} (unset)")
            continue
        paths = [os.path.join(home, "lib64", n) for n in LIB_NAMES]
        looked.append(os.path.join(home, "lib64"))
        if all(os.path.isfile(p) for p in paths):
            return paths, looked
    return None, looked


class AclnnRuntime:
    """The loaded libraries plus device and stream; :meth:`execute` runs a plan."""

    def __init__(self, libs: Optional[Sequence[str]] = None, device: int = 0):
        if libs is not None:
            self.paths: Optional[list[str]] = list(libs)
            self.looked = list(libs)
            if not all(os.path.isfile(p) for p in libs):
                self.paths = None
        else:
            self.paths, self.looked = find_libraries()
        self.device = device
        self._libs: list[ctypes.CDLL] = []
        self._stream: Optional[c_void_p] = None

    def availability(self) -> tuple[bool, str]:
        """``(True, "")`` when every library file exists, else ``(False, why)`` naming where it
        looked; loads nothing."""
        if self.paths is None:
            return False, ("CANN runtime not found: set ASCEND_HOME_PATH or ASCEND_TOOLKIT_HOME to "
                           f"a CANN install (looked for {', '.join(LIB_NAMES)} in "
                           f"{'; '.join(self.looked)})")
        return True, ""

    # -- symbols and checked calls --
    def _load(self) -> None:
        if self._libs:
            return
        ok, why = self.availability()
        if not ok:
            raise AclnnRuntimeError(why)
        self._libs = [ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL) for p in self.paths or ()]
        self.fn("aclInit", [c_char_p])(None)  # a repeated init (status != 0) is harmless
        self.check("aclrtSetDevice", self.fn("aclrtSetDevice", [c_int32])(self.device))
        stream = c_void_p()
        self.check("aclrtCreateStream", self.fn("aclrtCreateStream", [POINTER(c_void_p)])(byref(stream)))
        self._stream = stream

    def fn(self, name: str, argtypes: list, restype: Any = c_int) -> Callable[..., Any]:
        """The C function ``name`` from the first library exporting it."""
        for lib in self._libs:
            f = getattr(lib, name, None)
            if f is not None:
                f.argtypes, f.restype = argtypes, restype
                return f
        raise AclnnRuntimeError(f"symbol {name} not found in {', '.join(self.paths or ())}")

    def check(self, what: str, status: int) -> None:
        """Raise AclnnRuntimeError naming ``what``, ``status`` and aclGetRecentErrMsg unless
        ``status`` is 0."""
        if status != 0:
            msg = ""
            try:
                msg = (self.fn("aclGetRecentErrMsg", [], c_char_p)() or b"").decode(errors="replace")
            except AclnnRuntimeError:
                pass
            raise AclnnRuntimeError(f"{what} failed with status {status}" + (f": {msg}" if msg else ""))

    def malloc(self, nbytes: int) -> c_void_p:
        """``aclrtMalloc`` of ``nbytes`` bytes (at least 1), checked; the caller frees it."""
        p = c_void_p()
        self.check("aclrtMalloc", self.fn("aclrtMalloc", [POINTER(c_void_p), c_size_t, c_int])(
            byref(p), max(nbytes, 1), MALLOC_HUGE_FIRST))
        return p

    def memcpy(self, dst: Any, src: Any, nbytes: int, kind: int) -> None:
        """``aclrtMemcpy`` of ``nbytes`` bytes in direction ``kind`` (MEMCPY_H2D or MEMCPY_D2H),
        checked; none for 0 bytes."""
        if nbytes:
            self.check("aclrtMemcpy", self.fn("aclrtMemcpy", [c_void_p, c_size_t, c_void_p, c_size_t, c_int])(
                dst, nbytes, src, nbytes, kind))

    # -- running a plan --
    def execute(self, plan: CallPlan, storages: Mapping[str, np.ndarray]) -> None:
        """Run ``plan`` with user buffer ``name`` holding ``storages[name]`` (a flat contiguous
        array, updated in place for the buffers the plan writes)."""
        self._load()
        dev: dict[str, c_void_p] = {}
        allocs: list[c_void_p] = []
        handles: list[tuple[str, c_void_p]] = []
        try:
            for u in plan.users:
                host = np.ascontiguousarray(storages[u.name])
                dev[u.name] = self.malloc(host.nbytes)
                allocs.append(dev[u.name])
                self.memcpy(dev[u.name], host.ctypes.data, host.nbytes, MEMCPY_H2D)
            arena = self.malloc(plan.workspace_size) if plan.workspace_size else None
            if arena is not None:
                allocs.append(arena)
            for b in plan.plan_buffers:
                dev[b.name] = self.malloc(b.nbytes)
                allocs.append(dev[b.name])
            tensors = {t.id: self._tensor(t, dev, arena, handles) for t in plan.tensors}
            for call in plan.calls:
                self._call(call, tensors, handles)
            self.check("aclrtSynchronizeStream",
                       self.fn("aclrtSynchronizeStream", [c_void_p])(self._stream))
            for u in plan.users:
                if u.written:
                    host = storages[u.name]
                    self.memcpy(host.ctypes.data, dev[u.name], host.nbytes, MEMCPY_D2H)
        finally:
            for kind, h in reversed(handles):
                self.fn(f"aclDestroy{kind}", [c_void_p])(h)
            for p in allocs:
                self.fn("aclrtFree", [c_void_p])(p)

    def _tensor(self, t, dev, arena, handles) -> c_void_p:
        def arr(v):
            return (c_int64 * max(len(v), 1))(*v)
        if t.buffer in ("user", "plan"):
            base = dev[t.user].value
        else:
            base = arena.value + t.ws_offset
        create = self.fn("aclCreateTensor", [c_void_p, c_uint64, c_int, c_void_p, c_int64, c_int,
                                             c_void_p, c_uint64, c_void_p], c_void_p)
        h = create(arr(t.dims), len(t.dims), int(dtype_from_acl(t.dtype)), arr(t.strides), t.offset,
                   int(format_from_acl(t.format)), arr(t.storage_dims), len(t.storage_dims), base)
        if not h:
            raise AclnnRuntimeError(f"aclCreateTensor returned NULL for tensor {t.id}")
        handles.append(("Tensor", c_void_p(h)))
        return c_void_p(h)

    def _call(self, call, tensors, handles) -> None:
        args, types = [], []
        for a in call.args:
            if a.kind == "tensor":
                args.append(tensors[a.tensor] if a.tensor else None)
                types.append(c_void_p)
            elif a.kind == "int_array":
                h = self.fn("aclCreateIntArray", [c_void_p, c_uint64], c_void_p)(
                    (c_int64 * len(a.ints))(*a.ints), len(a.ints))
                handles.append(("IntArray", c_void_p(h)))
                args.append(c_void_p(h))
                types.append(c_void_p)
            elif a.kind == "scalar":
                d = dtype_from_acl(a.dtype)
                value = np.array([a.value], dtype=d.np)
                h = self.fn("aclCreateScalar", [c_void_p, c_int], c_void_p)(value.ctypes.data, int(d))
                handles.append(("Scalar", c_void_p(h)))
                args.append(c_void_p(h))
                types.append(c_void_p)
            elif a.kind == "dtype":
                args.append(int(dtype_from_acl(a.dtype)))
                types.append(c_int)
            elif a.kind in ("double", "float", "int64"):
                args.append(a.value if a.kind != "int64" else int(a.value))
                types.append({"double": c_double, "float": c_float, "int64": c_int64}[a.kind])
            else:
                args.append(a.flag)
                types.append(c_bool)
        ws, ex = c_uint64(0), c_void_p()
        phase1 = self.fn(call.phase1, types + [POINTER(c_uint64), POINTER(c_void_p)])
        self.check(call.phase1, phase1(*args, byref(ws), byref(ex)))
        wsp = self.malloc(ws.value) if ws.value else None
        try:
            phase2 = self.fn(call.api, [c_void_p, c_uint64, c_void_p, c_void_p])
            self.check(call.api, phase2(wsp, ws.value, ex, self._stream))
            if wsp is not None:  # the stream must be drained before the workspace is freed
                self.check("aclrtSynchronizeStream",
                           self.fn("aclrtSynchronizeStream", [c_void_p])(self._stream))
        finally:
            if wsp is not None:
                self.fn("aclrtFree", [c_void_p])(wsp)


class AclnnExecutable(Executable):
    """A graph lowered to call plans, one per layout of the user tensors (their offsets and
    storage sizes, which the plan's aclTensors describe; usually one), run on the runtime."""

    def __init__(self, runtime: AclnnRuntime, graph: Graph, mem: MemoryPlan):
        self.runtime, self.graph, self.mem = runtime, graph, mem
        self.plans: dict[tuple, CallPlan] = {}

    def plan_for(self, bindings: Mapping[str, Any]) -> CallPlan:
        """The call plan for ``bindings``' layout (each tensor's offset and storage size), lowered on
        first use and kept."""
        key = tuple((k, t.offset, t.storage.size) for k, t in sorted(bindings.items()))
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = lower(self.graph, bindings, mem=self.mem)
        return plan

    def run(self, bindings: Mapping[str, Any], workspace: Any = None) -> None:
        """The device arena is exactly the memory plan's size (what phase 1 reported); the
        Python-level ``workspace`` is host memory, so it stands for that arena, which is
        allocated on the device with aclrtMalloc."""
        self.runtime.execute(self.plan_for(bindings), {k: t.storage for k, t in bindings.items()})


class AclnnBackend(Backend):
    """Backend ``"aclnn"``: lower the graph to a call plan (once per layout of the user tensors)
    and run it on the CANN libraries."""

    name = "aclnn"

    def __init__(self, libs: Optional[Sequence[str]] = None, device: int = 0):
        self.runtime = AclnnRuntime(libs, device)

    def availability(self) -> tuple[bool, str]:
        """See :meth:`Backend.availability`; whether the CANN libraries were found."""
        return self.runtime.availability()

    def compile(self, graph: Graph, memory_plan: MemoryPlan, platform: Platform) -> AclnnExecutable:
        """See :meth:`Backend.compile`; nothing is lowered yet: each layout of the user tensors is
        lowered at its first run (:meth:`AclnnExecutable.plan_for`)."""
        return AclnnExecutable(self.runtime, graph, memory_plan)
