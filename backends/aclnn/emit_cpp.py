"""Emit a complete C++ host program from a call plan, in the style of the CANN op examples
(ops-nn norm/sync_batch_norm_backward_elemt/docs/aclnnBatchNormElemtBackward.md): ACL init, device tensors from the given input data, every call in the two-phase
pattern with status checks naming the call, one workspace per call, stream sync, copy back,
``result[i] is: v`` lines and full cleanup.

    >>> from backends.aclnn.plan import CallPlan, TensorDesc, UserBuffer
    >>> plan = CallPlan(op="demo", users=[UserBuffer(name="x", dtype="ACL_FLOAT", elems=2, written=True)],
    ...                 workspace_size=0, calls=[], tensors=[TensorDesc(id="x", dtype="ACL_FLOAT",
    ...                 dims=[2], strides=[1], storage_dims=[2], buffer="user", user="x")])
    >>> src, files = emit_cpp(plan, {"x": __import__("numpy").float32([1, 2])})
    >>> "aclInit(nullptr)" in src and files == {}
    True

Small inputs are embedded as arrays; inputs over ``embed_limit`` elements are read from
``<name>.bin`` files (returned in ``files`` for the caller to write next to the program).
"""
from __future__ import annotations

import math
import re
from typing import Iterable, Mapping, Optional

import numpy as np

from opgraph.core.opapi import op_api_specs
from .plan import Arg, Call, CallPlan, TensorDesc, UserBuffer, dtype_from_acl

HEADERS = {
    "aclnnCast": "aclnn_cast.h", "aclnnReduceSum": "aclnn_reduce_sum.h", "aclnnDiv": "aclnn_div.h",
    "aclnnExpand": "aclnn_expand.h", "aclnnInplaceCopy": "aclnn_copy.h",
    "aclnnInplaceFillScalar": "aclnn_fill_scalar.h", "aclnnInplaceOne": "aclnn_ones.h",
}


def header_for(api: str) -> Optional[str]:
    """The aclnnop header declaring ``api``: the generic ops' table, else the header of the
    registered op_api whose public API it is (None when unknown).

    >>> header_for("aclnnCast"), header_for("aclnnBatchNormElemtBackward")
    ('aclnn_cast.h', 'aclnn_batch_norm_elemt_backward.h')
    """
    if api in HEADERS:
        return HEADERS[api]
    return next((s.aclnn_header for s in op_api_specs().values() if s.aclnn_api == api), None)


C_TYPES = {"FLOAT": "float", "FLOAT16": "uint16_t", "BF16": "uint16_t", "INT32": "int32_t",
           "INT64": "int64_t", "INT8": "int8_t", "UINT8": "uint8_t", "DOUBLE": "double",
           "BOOL": "uint8_t", "INT16": "int16_t"}
FLOAT_BITS = {"float": (np.float32, np.uint32), "double": (np.float64, np.uint64)}  # value, bits
PRINT_AS_FLOAT = {"FLOAT16": "HalfToFloat", "BF16": "BFloat16ToFloat"}  # uint16_t bits -> float

PRELUDE = r'''#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <vector>

#include "acl/acl.h"
#include "aclnn/acl_meta.h"
{includes}

#define CHECK_RET(cond, return_expr) \
    do {                             \
        if (!(cond)) {               \
            return_expr;             \
        }                            \
    } while (0)

#define LOG_PRINT(message, ...) printf(message, ##__VA_ARGS__)

// A float / double from its IEEE bit pattern (NaN literals keep their sign and payload).
template <typename F, typename B>
static F FromBits(B bits) {
    static_assert(sizeof(F) == sizeof(B), "FromBits: F and B must have the same size");
    F f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// IEEE binary16 bits -> float (for printing float16 results).
[[maybe_unused]] static float HalfToFloat(uint16_t h) {
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            int e = -1;
            do { man <<= 1; ++e; } while ((man & 0x400u) == 0);
            bits = sign | (uint32_t)(112 - e) << 23 | (man & 0x3ffu) << 13;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | man << 13;
    } else {
        bits = sign | (exp + 112) << 23 | man << 13;
    }
    return FromBits<float>(bits);
}

// bfloat16 bits -> float: they are the upper half of the float's bits (for printing bf16 results).
[[maybe_unused]] static float BFloat16ToFloat(uint16_t b) {
    return FromBits<float>(static_cast<uint32_t>(b) << 16);
}

template <typename T>
static bool ReadBin(const char *path, std::vector<T> &data) {
    std::ifstream file(path, std::ios::binary);
    if (!file) {
        return false;
    }
    file.read(reinterpret_cast<char *>(data.data()), data.size() * sizeof(T));
    return static_cast<bool>(file);
}
'''


class Spelling:
    """Names as a program spells them — in its variables, ``.bin`` file names and messages:
    ASCII word characters only (a loaded graph's names may hold quotes, ``%``, ``/``), each
    name its own spelling (``a-b`` and ``a_b`` are ``a_b`` and ``a_b_1``).

        >>> spell = Spelling()
        >>> spell("37_c"), spell("a-b"), spell("a_b"), spell("a-b")
        ('37_c', 'a_b', 'a_b_1', 'a_b')
    """

    def __init__(self) -> None:
        self.made: dict[str, str] = {}

    def __call__(self, name: str) -> str:
        got = self.made.get(name)
        if got is None:
            got = base = re.sub(r"\W", "_", name, flags=re.ASCII)
            taken = set(self.made.values())
            k = 0
            while got in taken:
                k += 1
                got = f"{base}_{k}"
            self.made[name] = got
        return got


def ints(values: Iterable[int]) -> str:
    """A C++ braced initialiser of ``values`` (each as an int).

        >>> ints([2, 3, 1]), ints([])
        ('{2, 3, 1}', '{}')
    """
    return "{" + ", ".join(str(int(v)) for v in values) + "}"


def literal(v: float, ctype: str) -> str:
    """One element of an embedded array as a valid, exact C++ literal of ``ctype``: float32 as
    ``%.9g`` with a dot (reads back to the same float), double as its shortest repr, ±inf via
    ``std::numeric_limits`` and NaN from its bit pattern (sign and payload kept).

    >>> [literal(v, "float") for v in (8.0, -0.0, 1e10, np.float32(0.1))]
    ['8.0f', '-0.0f', '1.0e+10f', '0.100000001f']
    >>> literal(float("-inf"), "float"), literal(float("nan"), "double")
    ('-std::numeric_limits<float>::infinity()', 'FromBits<double>(UINT64_C(0x7ff8000000000000))')
    >>> literal(-2**31, "int32_t"), literal(65535, "uint16_t")
    ('INT32_MIN', '65535')
    """
    if ctype in FLOAT_BITS:
        f = float(v)
        if math.isnan(f):
            value_type, bits_type = FLOAT_BITS[ctype]
            bits, width = int(np.array(v, value_type).view(bits_type)), 2 * np.dtype(bits_type).itemsize
            return f"FromBits<{ctype}>(UINT{4 * width}_C(0x{bits:0{width}x}))"
        if math.isinf(f):
            return ("-" if f < 0 else "") + f"std::numeric_limits<{ctype}>::infinity()"
        text = f"{f:.9g}" if ctype == "float" else repr(f)
        mantissa, e, exponent = text.partition("e")
        if "." not in mantissa:
            mantissa += ".0"
        return mantissa + e + exponent + ("f" if ctype == "float" else "")
    i = int(v)
    if ctype.startswith("int") and i == np.iinfo(ctype[:-2]).min:
        return ctype[:-2].upper() + "_MIN"  # -2147483648 would be a negated out-of-range literal
    return str(i)


def host_bits(a: np.ndarray, dtype: str) -> np.ndarray:
    """The array as the C element type holds it (f16/bf16 as their uint16 bits)."""
    d = dtype_from_acl(dtype)
    a = np.ascontiguousarray(np.asarray(a).astype(d.np).reshape(-1))
    return a.view(np.uint16) if C_TYPES.get(d.name) == "uint16_t" else a


class Emitter:
    """Builds the program text line by line (``self.out``)."""

    def __init__(self, plan: CallPlan, data: Mapping[str, np.ndarray], embed_limit: int):
        self.plan, self.data, self.embed_limit = plan, data, embed_limit
        self.out: list[str] = []
        self.files: dict[str, bytes] = {}
        self.meta: list[tuple[str, str]] = []  # (destroy function, variable)
        self.label = Spelling()  # a user or plan buffer (host_ / dev_ variables, .bin files)
        self.tensor_name = Spelling()  # a tensor (t_ variables)

    def w(self, line: str = "", indent: int = 1) -> None:
        """Append ``line`` at ``indent`` levels of four spaces (an empty line without them)."""
        self.out.append("    " * indent + line if line else "")

    def check(self, cond: str, what: str, ret: str = "ret") -> None:
        """A ``CHECK_RET`` of ``cond`` that logs ``<what> failed`` with the value of ``ret`` and
        returns it from main."""
        self.w(f'CHECK_RET({cond}, LOG_PRINT("{what} failed. ERROR: %d\\n", {ret}); return {ret});')

    def user(self, u: UserBuffer) -> None:
        """Host vector and device buffer of user buffer ``u``: its data embedded (or all zeros), or
        read from ``<name>.bin`` above ``embed_limit`` elements; copied to the device."""
        ctype = C_TYPES[dtype_from_acl(u.dtype).name]
        name = self.label(u.name)
        host, dev = f"host_{name}", f"dev_{name}"
        values = host_bits(self.data[u.name], u.dtype) if u.name in self.data else None
        if values is not None and values.size != u.elems:
            raise ValueError(f"data for {u.name} has {values.size} elements, the plan needs {u.elems}")
        if values is not None and not values.view(np.uint8).any():
            values = None  # all bits zero (not -0.0, not NaN): a value-initialised vector
        if values is None or u.elems <= self.embed_limit:
            body = ", ".join(literal(v, ctype) for v in values) if values is not None else ""
            self.w(f"std::vector<{ctype}> {host}({u.elems});" if values is None else
                   f"std::vector<{ctype}> {host} = {{{body}}};")
        else:
            self.files[f"{name}.bin"] = values.tobytes()
            self.w(f"std::vector<{ctype}> {host}({u.elems});")
            self.w(f'CHECK_RET(ReadBin("{name}.bin", {host}), '
                   f'LOG_PRINT("cannot read {name}.bin\\n"); return 1);')
        size = f"{host}.size() * sizeof({ctype})"
        self.w(f"void *{dev} = nullptr;")
        self.w(f"ret = aclrtMalloc(&{dev}, {size}, ACL_MEM_MALLOC_HUGE_FIRST);")
        self.check("ret == ACL_SUCCESS", f"aclrtMalloc {name}")
        self.w(f"ret = aclrtMemcpy({dev}, {size}, {host}.data(), {size}, ACL_MEMCPY_HOST_TO_DEVICE);")
        self.check("ret == ACL_SUCCESS", f"aclrtMemcpy {name}")
        self.meta.append(("aclrtFree", dev))

    def tensor(self, t: TensorDesc) -> None:
        """The ``aclCreateTensor`` of ``t`` over its user or plan buffer or at its arena offset
        (nullptr when there is no workspace), destroyed at cleanup."""
        v = "t_" + self.tensor_name(t.id)
        addr = (f"dev_{self.label(t.user)}" if t.buffer in ("user", "plan")
                else f"static_cast<char *>(arena) + {t.ws_offset}" if self.plan.workspace_size
                else "nullptr")  # (an empty intermediate: no workspace, no arena)
        self.w(f"std::vector<int64_t> {v}_dims = {ints(t.dims)}, {v}_strides = {ints(t.strides)}, "
               f"{v}_storage = {ints(t.storage_dims)};")
        self.w(f"aclTensor *{v} = aclCreateTensor({v}_dims.data(), {v}_dims.size(), {t.dtype}, "
               f"{v}_strides.data(), {t.offset}, {t.format}, {v}_storage.data(), {v}_storage.size(), "
               f"{addr});")
        self.check(f"{v} != nullptr", f"aclCreateTensor {v[2:]}", "-1")
        self.meta.append(("aclDestroyTensor", v))

    def arg(self, a: Arg, i: int) -> str:
        """The C++ expression of argument ``a`` of call ``i``; an aclIntArray or aclScalar is created
        first (its variable named ``call<i>_<name>``) and destroyed at cleanup."""
        if a.kind == "tensor":
            return "t_" + self.tensor_name(a.tensor) if a.tensor else "nullptr"
        if a.kind == "dtype":
            return a.dtype
        if a.kind == "bool":
            return "true" if a.flag else "false"
        if a.kind == "double":
            return literal(np.float64(a.value), "double")
        if a.kind == "float":
            return literal(np.float32(a.value), "float")
        if a.kind == "int64":
            return f"static_cast<int64_t>({int(a.value)})"
        name = f"call{i}_{a.name}"
        if a.kind == "int_array":
            self.w(f"std::vector<int64_t> {name}_values = {ints(a.ints)};")
            self.w(f"aclIntArray *{name} = aclCreateIntArray({name}_values.data(), {name}_values.size());")
            self.check(f"{name} != nullptr", f"aclCreateIntArray {a.name}", "-1")
            self.meta.append(("aclDestroyIntArray", name))
        else:
            ctype = C_TYPES[dtype_from_acl(a.dtype).name]
            bits = host_bits(np.array([a.value]), a.dtype)[0]
            self.w(f"{ctype} {name}_value = {literal(bits, ctype)};")
            self.w(f"aclScalar *{name} = aclCreateScalar(&{name}_value, {a.dtype});")
            self.check(f"{name} != nullptr", f"aclCreateScalar {a.name}", "-1")
            self.meta.append(("aclDestroyScalar", name))
        return name

    def call(self, c: Call, i: int) -> None:
        """Call ``i`` in the two-phase pattern: ``GetWorkspaceSize``, a workspace allocated when its
        size is not 0 (freed at cleanup), then the API on the stream; each status checked."""
        self.w(f"// [{i}] {c.api}: {c.source}")
        args = [self.arg(a, i) for a in c.args]
        self.w(f"ret = {c.phase1}({', '.join(args)}, &workspaceSize, &executor);")
        self.check("ret == ACL_SUCCESS", f"{c.phase1} (call {i})")
        self.w("workspaceAddr = nullptr;")
        self.w("if (workspaceSize > 0) {")
        self.w("ret = aclrtMalloc(&workspaceAddr, workspaceSize, ACL_MEM_MALLOC_HUGE_FIRST);", 2)
        self.w(f'CHECK_RET(ret == ACL_SUCCESS, LOG_PRINT("allocate workspace of {c.api} (call {i}) '
               f'failed. ERROR: %d\\n", ret); return ret);', 2)
        self.w("workspaces.push_back(workspaceAddr);", 2)
        self.w("}")
        self.w(f"ret = {c.api}(workspaceAddr, workspaceSize, executor, stream);")
        self.check("ret == ACL_SUCCESS", f"{c.api} (call {i})")

    def result(self, u: UserBuffer) -> None:
        """Copy user buffer ``u`` back to the host and print it: one ``result[i] is: v`` line per
        element."""
        d = dtype_from_acl(u.dtype)
        name = self.label(u.name)
        ctype, host = C_TYPES[d.name], f"host_{name}"
        size = f"{host}.size() * sizeof({ctype})"
        self.w(f"ret = aclrtMemcpy({host}.data(), {size}, dev_{name}, {size}, "
               "ACL_MEMCPY_DEVICE_TO_HOST);")
        self.check("ret == ACL_SUCCESS", f"copy result {name} from device to host")
        value = (f"{PRINT_AS_FLOAT[d.name]}({host}[i])" if d.name in PRINT_AS_FLOAT
                 else f"{host}[i]")
        self.w(f'LOG_PRINT("{name}:\\n");')
        self.w(f"for (size_t i = 0; i < {host}.size(); i++) {{")
        self.w(f'LOG_PRINT("result[%zu] is: %.9g\\n", i, static_cast<double>({value}));', 2)
        self.w("}")

    def program(self) -> str:
        """The whole program's text: includes, ACL init, buffers, tensors, calls, stream sync,
        results of the written buffers, cleanup. ValueError for an API with no known header."""
        p = self.plan
        headers = {c.api: header_for(c.api) for c in p.calls}
        includes = "\n".join(f'#include "aclnnop/{h}"' for h in sorted(set(headers.values()) - {None}))
        unknown = [api for api, h in headers.items() if h is None]
        if unknown:
            raise ValueError(f"emit-cpp has no header for {', '.join(sorted(set(unknown)))}")
        self.out = [f"// Generated by opgraph emit-cpp from the call plan of {p.op} (level {p.level}):",
                    f"// {len(p.calls)} aclnn calls, workspace arena {p.workspace_size} bytes.",
                    PRELUDE.replace("{includes}", includes), "int main()", "{"]
        self.w("int32_t deviceId = 0;")
        self.w("aclrtStream stream = nullptr;")
        self.w("auto ret = aclInit(nullptr);")
        self.check("ret == ACL_SUCCESS", "aclInit")
        self.w("ret = aclrtSetDevice(deviceId);")
        self.check("ret == ACL_SUCCESS", "aclrtSetDevice")
        self.w("ret = aclrtCreateStream(&stream);")
        self.check("ret == ACL_SUCCESS", "aclrtCreateStream")
        self.w()
        self.w("// user tensors: host data -> device")
        for u in p.users:
            self.user(u)
        self.w()
        for b in p.plan_buffers:
            dev = f"dev_{self.label(b.name)}"
            self.w(f"void *{dev} = nullptr;  // a buffer the plan owns")
            self.w(f"ret = aclrtMalloc(&{dev}, {b.nbytes}, ACL_MEM_MALLOC_HUGE_FIRST);")
            self.check("ret == ACL_SUCCESS", f"aclrtMalloc {self.label(b.name)}")
            self.meta.append(("aclrtFree", dev))
        if p.workspace_size:
            self.w("// workspace arena for the intermediate tensors of the plan")
            self.w("void *arena = nullptr;")
            self.w(f"ret = aclrtMalloc(&arena, {p.workspace_size}, ACL_MEM_MALLOC_HUGE_FIRST);")
            self.check("ret == ACL_SUCCESS", "aclrtMalloc workspace arena")
            self.meta.append(("aclrtFree", "arena"))
        self.w()
        self.w("// aclTensors (user tensors, intermediates and views over them)")
        for t in p.tensors:
            self.tensor(t)
        self.w()
        self.w("std::vector<void *> workspaces;")
        if p.calls:
            self.w("uint64_t workspaceSize = 0;")
            self.w("aclOpExecutor *executor = nullptr;")
            self.w("void *workspaceAddr = nullptr;")
        for i, c in enumerate(p.calls):
            self.w()
            self.call(c, i)
        self.w()
        self.w("ret = aclrtSynchronizeStream(stream);")
        self.check("ret == ACL_SUCCESS", "aclrtSynchronizeStream")
        self.w()
        for u in p.users:
            if u.written:
                self.result(u)
        self.w()
        self.w("// cleanup")
        for fn, var in reversed(self.meta):
            if fn != "aclrtFree":
                self.w(f"{fn}({var});")
        self.w("for (void *addr : workspaces) {")
        self.w("aclrtFree(addr);", 2)
        self.w("}")
        for fn, var in reversed(self.meta):
            if fn == "aclrtFree":
                self.w(f"{fn}({var});")
        self.w("aclrtDestroyStream(stream);")
        self.w("aclrtResetDevice(deviceId);")
        self.w("aclFinalize();")
        self.w("return 0;")
        self.out.append("}")
        return "\n".join(self.out) + "\n"


def emit_cpp(plan: CallPlan, data: Optional[Mapping[str, np.ndarray]] = None, *,
             embed_limit: int = 4096) -> tuple[str, dict[str, bytes]]:
    """``(program source, {file name: bytes})`` for ``plan`` with user buffer ``name`` initialised
    from ``data[name]`` (flat storage; zeros when missing)."""
    em = Emitter(plan, data or {}, embed_limit)
    return em.program(), em.files
