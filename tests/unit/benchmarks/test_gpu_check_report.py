"""benchmarks/gpu_check.py: a failed section is reported by the line that names its failure."""
from conftest import load_script

gpu_check = load_script("gpu_check")


def test_the_exception_line_of_a_failed_section_is_its_error():
    log = ("===== learner: python benchmarks/bench_learner.py\n"
           "[rank0]: Traceback (most recent call last):\n"
           "[rank0]:   File \"x.py\", line 3, in <module>\n"
           "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.47 GiB.\n"
           "\n")
    assert gpu_check.last_error(log) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.47 GiB."


def test_a_log_without_an_exception_gives_its_last_line_cut_short():
    assert gpu_check.last_error("starting\n" + "x" * 300 + "\n") == "x" * 200
    assert gpu_check.last_error("") == ""
