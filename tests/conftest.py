import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from async_rl.run.directory import RunDir
from async_rl.sandbox import LocalSandbox, SandboxLimits
from async_rl.sandbox.local import tagged_processes
from async_rl.wire import RejectCounter, WireLimits, recv, send

ROOT = Path(__file__).resolve().parents[1]
INTEGRATION = Path(__file__).resolve().parent / "integration"


# Set by the vLLM test job (.ci/run): a test marked `vllm` fails there, instead of
# skipping, when vLLM cannot be imported.
REQUIRE_VLLM = "ASYNC_RL_REQUIRE_VLLM"


def pytest_collection_modifyitems(items):
    """Everything under tests/integration/ launches real processes: mark it, so that
    `-m "not integration"` (or `pytest tests/unit`) is the fast loop. A test marked
    `cuda(gpus=N)` skips, with the reason, where fewer than N CUDA devices are visible
    (`-m cuda` selects them all: benchmarks/gpu_check.py); one marked `vllm` where vLLM
    cannot be imported (`-m vllm` is the vLLM job)."""
    gpus = no_vllm = None
    for item in items:
        if INTEGRATION in Path(item.fspath).resolve().parents:
            item.add_marker(pytest.mark.integration)
        mark = item.get_closest_marker("cuda")
        if mark is not None:
            if gpus is None:
                import torch

                gpus = torch.cuda.device_count()
            need = int(mark.kwargs.get("gpus", 1))
            if gpus < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device(s), {gpus} visible"))
        if item.get_closest_marker("vllm") is not None and not os.environ.get(REQUIRE_VLLM):
            if no_vllm is None:
                no_vllm = vllm_missing()
            if no_vllm:
                item.add_marker(pytest.mark.skip(reason=no_vllm))


def vllm_missing() -> str:
    """Why vLLM cannot run here ("" when it can)."""
    from async_rl.weight_transfer.vllm.api import VLLMUnavailable, require_vllm

    try:
        require_vllm()
    except VLLMUnavailable as err:
        return str(err)
    return ""


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: one thread each (2-core CI) and this checkout's
    code first on the path, whatever copy of async_rl happens to be installed."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, **extra)


@pytest.fixture
def one_rank_mesh():
    """A one-process gloo world and its 1-device CPU mesh: FSDP2 code run in-process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of tiny in-process models (`pytestmark = pytest.mark.usefixtures(...)`):
    tiny ops gain nothing from intra-op threads, and on a shared, loaded CPU the OpenMP
    workers spin against other processes (measured: 8 s -> 70 s)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """The demo architecture and tokenizer, barely trained (these tests check plumbing, not learning)."""
    from async_rl.models.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("model") / "demo", seed=0, target_accuracy=0.0,
                            min_mixed_fraction=0.0)


@pytest.fixture(scope="session")
def reward_model_dir(tmp_path_factory):
    """A randomly initialized reward model (one output) of the demo's architecture and tokenizer."""
    import torch
    from transformers import LlamaForSequenceClassification

    from async_rl.models.demo import build_config, build_tokenizer

    torch.manual_seed(0)
    config = build_config()
    config.num_labels = 1
    path = tmp_path_factory.mktemp("rm") / "reward_model"
    LlamaForSequenceClassification(config).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def alive(pid: int) -> bool:
    """Is `pid` a live process (not gone, not a zombie waiting to be reaped)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


def survivors(pids, timeout: float = 30.0) -> list[int]:
    """Those of `pids` still alive after up to `timeout` seconds: processes that were
    stopped, or whose parent was, take their time to end on a loaded machine."""
    deadline = time.time() + timeout
    while (left := [p for p in pids if alive(p)]) and time.time() < deadline:
        time.sleep(0.05)
    return left


def kill_tree(proc: subprocess.Popen) -> list[int]:
    """SIGKILL a process and everything below it, all at once (a machine failure; also
    the cleanup of a failed test: the launcher's children lead their own sessions, so
    killing the launcher alone would orphan them). Returns the pids it killed."""
    import signal
    import time

    from async_rl.run.processes import process_tree

    tree = process_tree(proc.pid)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=10)
    deadline = time.time() + 10
    while time.time() < deadline and any(
            Path(f"/proc/{p}/status").exists() and "\nState:\tZ" not in Path(f"/proc/{p}/status").read_text()
            for p in tree[1:]):
        time.sleep(0.05)
    return tree


def train(run_dir: Path, model: Path, *overrides: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """`async-rl train` on the demo config, shrunk to a few small steps."""
    small = ["train.batch_groups=8", "train.group_size=4", "actors.groups_per_request=4", "eval.every=2"]
    if not {"task.name=jsonl", "task.name=dataset"} & set(overrides):  # their held-out sets are their own
        small.append("task.eval_size=32")
    cmd = [sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"), f"run_dir={run_dir}",
           f"model.path={model}", *small, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(step lines, evaluation lines) of a finished run's metrics.jsonl: every line must
    be a whole JSON object."""
    return RunDir(run_dir).steps_and_evals(strict=True)


@contextlib.contextmanager
def running_coordinator(run_dir: Path, config: dict, **options):
    """A real Coordinator (its own thread and ZeroMQ sockets) for a small synchronous run,
    with a one-tensor weight broadcaster; yields (coordinator, zmq context, task).
    `options` go to the Coordinator (prompt_over_limit, prompt_limit)."""
    import torch
    import zmq

    from async_rl.config import build_config
    from async_rl.coordinator.coordinator import Coordinator
    from async_rl.tasks import make_task
    from async_rl.weight_transfer.sender import WeightSender

    cfg = build_config({"max_staleness": 0, "learner": {"ranks": 1}, "transport": {"timeout_s": 5}, **config})
    task = make_task("arithmetic", seed=0)
    bc = WeightSender([("w", (4,), torch.float32)], bucket_mb=1, host="127.0.0.1", backend="gloo",
                           device=torch.device("cpu"), timeout_s=5)
    coord = Coordinator(cfg, task, bc, run_dir, **options)
    coord.start()
    ctx = zmq.Context()
    try:
        yield coord, ctx, task
    finally:
        coord.stop(drain_s=0.2)
        bc.close()
        ctx.destroy(linger=0)


def wait_for_job(bc, members, newer_than=0, timeout=15.0):
    """The broadcaster's job once it serves `members` in an epoch after `newer_than`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = bc.job()
        if job is not None and job.members == tuple(members) and job.epoch > newer_than:
            return job
        time.sleep(0.01)
    raise AssertionError(f"no broadcast job for members {members} within {timeout}s")


CHAT_TEMPLATE = (  # SmolLM2's template, shortened: a default system turn, then the conversation
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def build_chat_tokenizer(template: str | None = CHAT_TEMPLATE, add_bos: bool = False):
    """A small byte-level BPE tokenizer with chat special tokens (<|im_start|> = BOS,
    <|im_end|> = EOS, as in SmolLM2), trained in-process on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    corpus = ["What is 7 + 5? Answer with just the number.", "Tom has 3 apples and gets 4 more.",
              "system user assistant Be brief.", "The answer is 12.", "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16"] * 20
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if add_bos:
        core.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                         special_tokens=[("<|im_start|>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  unk_token="<|endoftext|>", pad_token="<|im_end|>")
    if template is not None:
        tok.chat_template = template
    return tok


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (vocabulary 16, 2 layers) as an HF directory, no tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=64)).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> Path:
    """A tiny random Llama with the chat tokenizer above, as an HF directory whose
    generation_config.json names one more stop id (as Qwen2.5's and Llama 3's do)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = build_chat_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                                         pad_token_id=2, tie_word_embeddings=True))
    out = tmp_path_factory.mktemp("chat") / "model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 0], pad_token_id=2).save_pretrained(out)
    return out


# How long a test waits for something that should come at once: long enough for a
# loaded machine, and only spent when it never comes.
PATIENCE_S = 30.0


def dealer(ctx, addr):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.RCVTIMEO, int(PATIENCE_S * 1000))
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    return s


def ask(sock, msg):
    send(sock, msg)
    _, reply = recv(sock, WireLimits(), RejectCounter(), routed=False)
    return reply


def wait_for(pred, timeout=PATIENCE_S):
    deadline = time.time() + timeout
    while not pred() and time.time() < deadline:
        time.sleep(0.01)
    return pred()


def truncate_half(path: Path) -> None:
    """Damage a file: keep its first half (a write cut short)."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_one_bit(path: Path) -> None:
    """Damage a file: same size, one bit off in the middle (bit-rot)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def load_script(name: str):
    """Import analysis/NAME.py or benchmarks/NAME.py (the scripts are not a package)
    under its own module name: dataclasses look their module up, and scripts import
    their siblings by name."""
    import importlib.util

    folder = next(ROOT / f for f in ("analysis", "benchmarks") if (ROOT / f / f"{name}.py").exists())
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))  # as when the script runs
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def read_tensorboard(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"histograms": 0, "tensors": 0, "scalars": 0})
    acc.Reload()
    return acc


def layout_categories(acc) -> list[str]:
    from tensorboard.plugins.custom_scalar import layout_pb2

    assert "custom_scalars__config__" in acc.PluginTagToContent("custom_scalars")
    layout = layout_pb2.Layout()
    layout.ParseFromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    return [c.title for c in layout.category]


def text_at(acc, step: int) -> str:
    from async_rl.run.metrics import GENERATIONS_TAG

    events = [e for e in acc.Tensors(f"{GENERATIONS_TAG}/text_summary") if e.step == step]
    assert len(events) == 1
    return events[0].tensor_proto.string_val[0].decode()


# --- the sandbox's tests: sandboxes with short limits, and runs checked for containment ---

SANDBOX_DEADLINE_S = 1.0
SANDBOX_LIMITS = SandboxLimits(timeout_s=SANDBOX_DEADLINE_S, cpu_s=5, memory_mb=256)


@pytest.fixture(scope="session")
def sandbox():
    """Isolated where this machine allows."""
    return LocalSandbox(SANDBOX_LIMITS, max_concurrency=2)


@pytest.fixture(scope="session")
def unisolated_sandbox():
    return LocalSandbox(SANDBOX_LIMITS, max_concurrency=2, isolate=False)


@pytest.fixture
def isolated(sandbox):
    if not sandbox.isolation.namespaces:
        pytest.skip(f"needs namespaces, and here: {sandbox.isolation.label}")
    return sandbox


@pytest.fixture
def contained():
    """Runs code and checks that the run was contained: it returned by its deadline plus
    a second, and left no process and no thread behind."""

    def run(sandbox: LocalSandbox, code: str, **kwargs):
        threads = threading.active_count()
        deadline = kwargs.get("timeout_s") or sandbox.limits.timeout_s
        started = time.monotonic()
        result = sandbox.run(code, **kwargs)
        elapsed = time.monotonic() - started
        assert elapsed <= deadline + 1.0, f"returned after {elapsed:.2f} s, deadline {deadline} s: {result}"
        assert tagged_processes(result.run_id) == [], f"processes of the run left behind: {result}"
        assert threading.active_count() == threads
        return result

    return run


def mounted_tmpfs(mount: Path, size: str):
    """A real tmpfs of `size` at `mount` (needs root: the test is skipped without)."""
    import subprocess

    mount.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    return mount


@pytest.fixture
def small_disk(tmp_path):
    """A real 256 KiB file system (tmpfs; needs root), unmounted afterwards."""
    import subprocess

    yield mounted_tmpfs(tmp_path / "disk", "256k")
    subprocess.run(["umount", str(tmp_path / "disk")], check=True)


@pytest.fixture
def full_disk(tmp_path):
    """A real file system with no byte left (a 64 KiB tmpfs, filled), unmounted afterwards."""
    import subprocess

    mount = mounted_tmpfs(tmp_path / "full", "64k")
    with open(mount / "filler", "wb", buffering=0) as out:
        try:
            while out.write(b"\0" * 4096):
                pass
        except OSError:  # ENOSPC: full
            pass
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


class CountingTokenizer:
    """A tokenizer's face over another, counting the characters it is asked to tokenize."""

    def __init__(self, inner):
        self.inner, self.chars = inner, 0
        self.chat_template, self.bos_token_id = inner.chat_template, inner.bos_token_id

    def __call__(self, text, **options):
        self.chars += len(text)
        return self.inner(text, **options)

    def __getattr__(self, name):
        return getattr(self.inner, name)
