"""profiling.idle_account and copy_account on hand-made Chrome traces: the idle time inside the profiled steps, each
idle stretch charged to what ended it (the launching operator and its phase, or a host wait); each copy's device time
charged to the operators around its launch. The GPU run writes the real one
(docs/bench/profiles/); the CPU profile itself is tested in test_learning.py."""
from raytrain_scu.worker.profiling import copy_account, device_account, idle_account


def x(name, cat, ts, dur, pid=1, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args}


def test_idle_stretches_are_charged_to_what_ended_them():
    ev = [x("ProfilerStep#3", "user_annotation", 0, 1000), x("ProfilerStep#4", "user_annotation", 1000, 1000),
          # step 3: a kernel 0-400, idle 400-700 ended by a launch inside Optimizer.step > aten::_foreach_add
          x("Optimizer.step#AdamW.step", "cpu_op", 500, 300), x("aten::_foreach_add", "cpu_op", 650, 30),
          x("cudaLaunchKernel", "cuda_runtime", 660, 5, correlation=2),
          x("k1", "kernel", 0, 400, pid=0, tid=7, correlation=1), x("k2", "kernel", 700, 300, pid=0, tid=7,
                                                                       correlation=2),
          # step 4: a device-to-host wait ends at 1100, then the next kernel starts at 1500: charged to the wait
          x("cudaMemcpyAsync", "cuda_runtime", 1000, 10, correlation=3),
          x("cudaStreamSynchronize", "cuda_runtime", 1010, 90, correlation=4),
          x("memcpy DtoH", "gpu_memcpy", 1000, 10, pid=0, tid=7, correlation=3),
          x("aten::mm", "cpu_op", 1400, 50), x("cudaLaunchKernel", "cuda_runtime", 1410, 5, correlation=5),
          x("k3", "kernel", 1500, 490, pid=0, tid=7, correlation=5),
          x("tiny gap kernel", "kernel", 1995, 5, pid=0, tid=7)]  # a 5 us gap: launch latency, not counted
    text = idle_account({"traceEvents": ev}, steps=2)
    # idle: 400-700 (300 us) and 1010-1500 (490 us) = 790 us over 2 steps
    assert text.startswith("device idle per step: 0.40 ms of 1.00 ms wall"), text
    rows = text.splitlines()[2:]
    assert rows[0].split() == ["0.24", "0.5", "host", "waited", "for", "the", "device", "|", "cudaStreamSynchronize"]
    assert rows[1].split() == ["0.15", "0.5", "Optimizer.step#AdamW.step", "|", "aten::_foreach_add"]
    assert len(rows) == 2


def test_a_trace_without_steps_says_so():
    assert idle_account({"traceEvents": []}, steps=1).startswith("device idle: no ProfilerStep")


def test_copies_are_charged_to_the_operators_around_their_launch():
    ev = [x("ProfilerStep#3", "user_annotation", 0, 1000), x("ProfilerStep#4", "user_annotation", 1000, 1000),
          # two casts inside a backward's contiguous call, one per step; one memcpy under aten::to; a Triton cast and
          # transpose; a GEMM and a Triton kernel named after a cast it fused (no copies)
          x("MyFnBackward", "cpu_op", 100, 200), x("aten::contiguous", "cpu_op", 110, 50), x("aten::copy_", "cpu_op",
                                                                                           120, 20),
          x("cudaLaunchKernel", "cuda_runtime", 125, 5, correlation=1),
          x("MyFnBackward", "cpu_op", 1100, 200), x("aten::contiguous", "cpu_op", 1110, 50),
          x("aten::copy_", "cpu_op", 1120, 20), x("cudaLaunchKernel", "cuda_runtime", 1125, 5, correlation=2),
          x("aten::to", "cpu_op", 1400, 30), x("cudaMemcpyAsync", "cuda_runtime", 1405, 5, correlation=3),
          x("aten::mm", "cpu_op", 1500, 30), x("cudaLaunchKernel", "cuda_runtime", 1505, 5, correlation=4),
          x("void at::native::direct_copy_kernel_cuda", "kernel", 200, 300, pid=0, tid=7, correlation=1),
          x("void at::native::direct_copy_kernel_cuda", "kernel", 1200, 100, pid=0, tid=7, correlation=2),
          x("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 1410, 40, pid=0, tid=7, correlation=3),
          x("nvjet_gemm", "kernel", 1510, 400, pid=0, tid=7, correlation=4),
          x("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "kernel", 1920, 50, pid=0, tid=7),  # a norm
          x("triton_poi_fused__to_copy_t_1", "kernel", 1975, 20, pid=0, tid=7),  # a cast and a transpose only
          x("void at::native::direct_copy_kernel_cuda", "kernel", 2500, 100, pid=0, tid=7, correlation=2)]  # after
    text = copy_account({"traceEvents": ev}, steps=2)
    assert text.startswith("device copies per step: 0.23 ms in 2.0 copies"), text
    rows = text.splitlines()[2:]
    assert rows[0].split() == ["0.20", "1.0", "MyFnBackward", ">", "aten::contiguous", ">", "aten::copy_"]
    assert rows[1].split() == ["0.02", "0.5", "aten::to"]
    assert rows[2].split() == ["0.01", "0.5", "-"]  # its launch is not in the trace
    assert len(rows) == 3
    assert copy_account({"traceEvents": []}, steps=1).startswith("device copies: no ProfilerStep")


def test_a_trace_of_the_device_alone_names_each_idle_stretch_by_the_kernels_around_it():
    """train.profile_host=false: no host operators, so each stretch is named by the kernel that ended before it (the
    one that ended last, not the last to start) and the one that started it; overlapping work counts once in the
    span."""
    ev = [x("gemm", "kernel", 0, 400, pid=0, tid=7), x("copy", "gpu_memcpy", 100, 100, pid=0, tid=8),
          x("norm", "kernel", 700, 300, pid=0, tid=7),     # 300 us idle after gemm (the copy ended before it)
          x("gemm", "kernel", 1010, 390, pid=0, tid=7),    # a 10 us gap: launch latency, not counted
          x("adam", "kernel", 1600, 200, pid=0, tid=7),    # 200 us idle after gemm
          x("norm", "kernel", 1900, 100, pid=0, tid=7),    # 100 us idle after adam
          x("cpu thing", "cpu_op", 0, 5000), x("cudaLaunchKernel", "cuda_runtime", 10, 5)]  # not device work
    text = device_account({"traceEvents": ev}, steps=2)
    assert text.startswith("steps profiled: 2, the device alone; per step: span 1.00 ms, kernels, copies and memsets "
                           "0.74 ms, idle 0.30 ms (stretches >= 20 us)"), text
    rows = [line.split() for line in text.splitlines()[2:]]
    assert rows == [["0.15", "0.5", "gemm", "|", "norm"], ["0.10", "0.5", "gemm", "|", "adam"],
                    ["0.05", "0.5", "adam", "|", "norm"]]
    assert device_account({"traceEvents": []}, steps=1).startswith("device: no kernels")
