"""aclnnBatchNormElemtBackward in FLOAT — the Python twin of ops-nn's
examples/test_aclnn_batch_norm_elemt_backward.cpp (the article's section 6).

    gradOut = input = 0..7 (shape 1,2,4), mean {0,0}, invstd {1,1}, weight {1,1},
    sumDy {0,0}, sumDyXmu {1,1}, counter {5,5}  →  result[i] = 0.9 * i

Run: python examples/batch_norm_elemt_backward.py
"""
import sys

import numpy as np

import opgraph
from opgraph.aclnn import (aclGetRecentErrMsg, aclnnBatchNormElemtBackward,
                           aclnnBatchNormElemtBackwardGetWorkspaceSize)


def CHECK_RET(ret, what):
    """The C example's CHECK_RET(ret == ACL_SUCCESS, LOG_PRINT(...); return ret)."""
    if ret != opgraph.Status.ACLNN_SUCCESS:
        print(f"{what} failed. ERROR: {int(ret)} {aclGetRecentErrMsg()}")
        sys.exit(1)


def main() -> int:
    # 1. (device/stream init: nothing to do on the CPU reference)
    # 2. build the inputs and the output on the host; opgraph.tensor shares their memory
    grad_out_host = np.arange(8, dtype=np.float32).reshape(1, 2, 4)
    input_host = np.arange(8, dtype=np.float32).reshape(1, 2, 4)
    grad_input_host = np.zeros((1, 2, 4), dtype=np.float32)
    gradOut = opgraph.tensor(grad_out_host)
    input = opgraph.tensor(input_host)
    mean = opgraph.tensor(np.float32([0, 0]))
    invstd = opgraph.tensor(np.float32([1, 1]))
    weight = opgraph.tensor(np.float32([1, 1]))
    sumDy = opgraph.tensor(np.float32([0, 0]))
    sumDyXmu = opgraph.tensor(np.float32([1, 1]))
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

    # 5. read the result back (it is already in grad_input_host)
    for i, v in enumerate(grad_input_host.ravel()):
        print(f"result[{i}] is: {v:f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
