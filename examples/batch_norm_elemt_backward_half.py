"""aclnnBatchNormElemtBackward in FLOAT16 — the Python twin of ops-nn's
examples/test_aclnn_batch_norm_elemt_backward_half.cpp.

All seven float inputs are FLOAT16, so the op computes in FLOAT16 (design §4): the result is
0.9 * i rounded step by step in half precision, e.g. result[1] = 0.899902.

Run: python examples/batch_norm_elemt_backward_half.py
"""
import sys

import numpy as np

import opgraph
from opgraph.aclnn import (aclGetRecentErrMsg, aclnnBatchNormElemtBackward,
                           aclnnBatchNormElemtBackwardGetWorkspaceSize)


def CHECK_RET(ret, what):
    if ret != opgraph.Status.ACLNN_SUCCESS:
        print(f"{what} failed. ERROR: {int(ret)} {aclGetRecentErrMsg()}")
        sys.exit(1)


def main() -> int:
    half = np.float16
    grad_input_host = np.zeros((1, 2, 4), dtype=half)
    gradOut = opgraph.tensor(np.arange(8, dtype=half).reshape(1, 2, 4))
    input = opgraph.tensor(np.arange(8, dtype=half).reshape(1, 2, 4))
    mean = opgraph.tensor(np.array([0, 0], dtype=half))
    invstd = opgraph.tensor(np.array([1, 1], dtype=half))
    weight = opgraph.tensor(np.array([1, 1], dtype=half))
    sumDy = opgraph.tensor(np.array([0, 0], dtype=half))
    sumDyXmu = opgraph.tensor(np.array([1, 1], dtype=half))
    counter = opgraph.tensor(np.float32([5, 5]))          # counter: FLOAT, FLOAT16 or INT32
    gradInput = opgraph.tensor(grad_input_host)

    ret, workspaceSize, executor = aclnnBatchNormElemtBackwardGetWorkspaceSize(
        gradOut, input, mean, invstd, weight, sumDy, sumDyXmu, counter, gradInput)
    CHECK_RET(ret, "aclnnBatchNormElemtBackwardGetWorkspaceSize")
    print(f"workspaceSize = {workspaceSize}, {len(executor.graph.nodes)} l0 ops recorded")

    workspaceAddr = bytearray(workspaceSize) if workspaceSize > 0 else None
    ret = aclnnBatchNormElemtBackward(workspaceAddr, workspaceSize, executor, None)
    CHECK_RET(ret, "aclnnBatchNormElemtBackward")

    for i, v in enumerate(grad_input_host.ravel()):
        print(f"result[{i}] is: {float(v):f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
