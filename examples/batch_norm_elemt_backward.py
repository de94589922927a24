"""aclnnBatchNormElemtBackward — the Python twin of ops-nn's three examples for it (the article's
section 6): examples/test_aclnn_batch_norm_elemt_backward.cpp (FLOAT, the default here),
..._half.cpp (``--dtype float16``) and ..._bfloat16.cpp (``--dtype bfloat16``).

    gradOut = input = 0..7 (shape 1,2,4), mean {0,0}, invstd {1,1}, weight {1,1},
    sumDy {0,0}, sumDyXmu {1,1}, counter {5,5}  →  result[i] = 0.9 * i

in the dtype asked for (counter stays FLOAT: it takes FLOAT, FLOAT16 or INT32, never BF16):
- FLOAT16: all seven float inputs are FLOAT16, so the op computes in FLOAT16 (design §4): 0.9 * i
  rounded step by step in half precision, e.g. result[1] = 0.899902;
- BFLOAT16 (numpy arrays of ``ml_dtypes.bfloat16``): always computed in FLOAT and rounded back
  to BF16 at the end, so result[1] = bf16(0.9) = 0.898438. BF16 is accepted on Ascend910B /
  Ascend910_93 / Ascend950 (the default platform is Ascend910B).

Run: python examples/batch_norm_elemt_backward.py [--dtype float|float16|bfloat16]
"""
import argparse
import sys

import ml_dtypes
import numpy as np

import opgraph
from opgraph.aclnn import (aclGetRecentErrMsg, aclnnBatchNormElemtBackward,
                           aclnnBatchNormElemtBackwardGetWorkspaceSize)

DTYPES = {"float": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def CHECK_RET(ret, what):
    """The C example's CHECK_RET(ret == ACL_SUCCESS, LOG_PRINT(...); return ret)."""
    if ret != opgraph.Status.ACLNN_SUCCESS:
        print(f"{what} failed. ERROR: {int(ret)} {aclGetRecentErrMsg()}")
        sys.exit(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float")
    dt = DTYPES[ap.parse_args(argv).dtype]

    # 1. (device/stream init: nothing to do on the CPU reference)
    # 2. build the inputs and the output on the host; opgraph.tensor shares their memory
    grad_out_host = np.arange(8).reshape(1, 2, 4).astype(dt)
    input_host = np.arange(8).reshape(1, 2, 4).astype(dt)
    grad_input_host = np.zeros((1, 2, 4), dtype=dt)
    gradOut = opgraph.tensor(grad_out_host)
    input = opgraph.tensor(input_host)
    mean = opgraph.tensor(np.array([0, 0], dtype=dt))
    invstd = opgraph.tensor(np.array([1, 1], dtype=dt))
    weight = opgraph.tensor(np.array([1, 1], dtype=dt))
    sumDy = opgraph.tensor(np.array([0, 0], dtype=dt))
    sumDyXmu = opgraph.tensor(np.array([1, 1], dtype=dt))
    counter = opgraph.tensor(np.float32([5, 5]))
    gradInput = opgraph.tensor(grad_input_host)

    # 3. phase 1: check the arguments, record the graph, get the workspace size
    ret, workspaceSize, executor = aclnnBatchNormElemtBackwardGetWorkspaceSize(
        gradOut, input, mean, invstd, weight, sumDy, sumDyXmu, counter, gradInput)
    CHECK_RET(ret, "aclnnBatchNormElemtBackwardGetWorkspaceSize")
    print(f"workspaceSize = {workspaceSize}, {len(executor.graph.nodes)} l0 ops recorded")

    workspaceAddr = bytearray(workspaceSize) if workspaceSize > 0 else None

    # 4. phase 2: run the graph
    ret = aclnnBatchNormElemtBackward(workspaceAddr, workspaceSize, executor, None)
    CHECK_RET(ret, "aclnnBatchNormElemtBackward")

    # 5. read the result back (it is already in grad_input_host; BF16 printed as float)
    for i, v in enumerate(grad_input_host.ravel()):
        print(f"result[{i}] is: {float(v):f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
