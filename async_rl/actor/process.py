"""The actor's process: one generation engine, driven by the hub.

Loop: ask the hub for work -> (join a weight sync (sync.py) | make the granted prompts'
samples and push one message per group (rollout/) | score a chunk of held-out prompts
and push the result | wait). New weights are applied between generation batches, so
every token of a batch has one version; with `sync.in_flight=true` also between decode
steps. A heartbeat thread with its own socket keeps the actor alive in the registry
while a long batch runs, and ships the actor's timeline spans (generate, score, push,
wait-for-admission, sync; run/tracing.py) to the hub with each heartbeat.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

import torch
import zmq

from async_rl.actor.engines import make_engine
from async_rl.actor.engines.vllm_engine import VLLMConfigError
from async_rl.actor.hub_client import ConnectError, HubClient, register
from async_rl.actor.rollout.rollout import Rollout
from async_rl.actor.scoring import Scorer
from async_rl.actor.sync import InFlight, LeaveNow, Syncer
from async_rl.config import from_yaml
from async_rl.device import collective_backend, resolve_device
from async_rl.models.loading import quiet_libraries
from async_rl.rewards.pool import RewardPoolError
from async_rl.run.processes import peak_rss_mb
from async_rl.run.tracing import SpanRecorder, WaitSpan, now_us, spans_to_arrays
from async_rl.tasks import task_from_config
from async_rl.tasks.prompt_format import prompt_format_for, stop_token_ids
from async_rl.weight_transfer.receiver import ParameterReceiver
from async_rl.weight_transfer.vllm.api import VLLMUnavailable
from async_rl.wire import (
    EvalGrant,
    EvalResult,
    Goodbye,
    Heartbeat,
    Hello,
    SyncOrder,
    TraceSpans,
    Wait,
    Welcome,
    WireLimits,
    WorkGrant,
    WorkRequest,
    encode,
    send,
)
from async_rl.wire.curve import secure_client

log = logging.getLogger("async_rl.actor")


def _ship_spans(sock: zmq.Socket, actor_id: int, spans: SpanRecorder, *, flags: int = 0) -> None:
    """Send the oldest pending spans (at most one message's worth); spans that cannot
    be sent are counted as dropped, in the next message."""
    taken, dropped = spans.take(WireLimits().max_trace_spans)
    if not taken and not dropped:
        return
    names, start_us, dur_us, args = spans_to_arrays(taken)
    try:
        send(sock, TraceSpans(actor_id=actor_id, dropped=dropped, names=names, start_us=start_us, dur_us=dur_us,
                              args=args), flags=flags)
    except zmq.ZMQError:
        spans.count_lost(len(taken) + dropped)


def _heartbeat_loop(ctx: zmq.Context, hub_addr: str, keys_dir: str | None, state: dict, spans: SpanRecorder,
                    stop: threading.Event, every_s: float) -> None:
    client = HubClient(ctx, hub_addr, timeout_s=every_s * 5, keys_dir=keys_dir)
    try:
        while not stop.wait(every_s):
            try:
                send(client.sock, Heartbeat(actor_id=state["actor_id"], version=state["version"],
                                            generated_groups=state["generated"], peak_rss_mb=peak_rss_mb()))
            except zmq.Again:
                continue  # the hub is busy; the main loop notices a dead hub through its own timeouts
            _ship_spans(client.sock, state["actor_id"], spans)
    finally:
        client.close(linger_ms=1000)  # spans just queued go out instead of being lost uncounted


def run_actor(hub_addr: str, name: str | None = None, keys_dir: str | None = None,
              connect_timeout_s: float = 60.0) -> int:
    """`keys_dir`: the directory of `async-rl keys`, when the hub requires CURVE.
    `connect_timeout_s`: how long to keep trying a hub that does not answer."""
    ctx = zmq.Context()
    name = name or f"actor-{socket.gethostname()}-{os.getpid()}"
    try:
        hub, welcome = register(ctx, hub_addr, name, keys_dir, connect_timeout_s)
    except ConnectError as err:
        print(f"async-rl: actor {name}: {err}", file=sys.stderr, flush=True)
        ctx.destroy(linger=0)
        return 2
    cfg = from_yaml(welcome.config_yaml)
    actor_id = welcome.actor_id
    state = {"actor_id": actor_id, "version": 0, "generated": 0, "epoch": -1}
    spans = SpanRecorder()  # pending until the heartbeat thread ships them
    waiting = WaitSpan(spans, "wait-for-admission")
    stop = threading.Event()
    # Beat from registration on: loading the model may take longer than
    # actors.heartbeat_timeout_s, and a silent newcomer would be reaped as dead.
    beat = threading.Thread(target=_heartbeat_loop, daemon=True,
                            args=(ctx, hub_addr, keys_dir, state, spans, stop, cfg.actors.heartbeat_s))
    beat.start()
    push = rollout = scorer = None
    try:
        quiet_libraries()
        torch.set_num_threads(cfg.actors.threads)
        hub.sock.setsockopt(zmq.RCVTIMEO, int(cfg.transport.timeout_s * 1000))
        device = resolve_device(cfg.model.device)
        prompt_format = prompt_format_for(cfg.model.path, cfg.task)
        stops = dict(eos_token_id=stop_token_ids(cfg.model.path, prompt_format.tokenizer))
        if cfg.actors.stop:
            stops.update(stop_strings=cfg.actors.stop, tokenizer=prompt_format.tokenizer)
        engine_cfg = cfg.actors.engine
        if engine_cfg.name == "vllm":
            options = dict(seed=cfg.seed, threads=cfg.actors.threads, **engine_cfg.model_dump(exclude={"name"}))
        else:
            options = dict(dtype=getattr(torch, engine_cfg.dtype), attention=engine_cfg.attention,
                           compile=engine_cfg.compile)
        options["lora"] = cfg.model.lora if cfg.model.lora.rank else None
        try:
            engine = make_engine(engine_cfg.name, model_or_path=cfg.model.path, device=device, **stops, **options)
        except (VLLMUnavailable, VLLMConfigError) as err:  # the engine cannot run here: one line
            print(f"async-rl: actor {name}: {err}", file=sys.stderr, flush=True)
            return 2
        generator = torch.Generator(device=device).manual_seed(cfg.seed * 1000 + actor_id)
        try:
            rollout = Rollout.from_config(cfg, engine, prompt_format, task_from_config(cfg.task, cfg.seed), generator)
        except RewardPoolError as err:  # the reward does not even import: one line, as a bad config
            print(f"async-rl: actor {name}: {err}", file=sys.stderr, flush=True)
            return 2
        sync_args = dict(bucket_mb=cfg.sync.bucket_mb, backend=collective_backend(device), timeout_s=cfg.sync.timeout_s)
        make_receiver = getattr(engine, "weight_receiver", None)  # engines whose weights live elsewhere (vLLM)
        receiver = (make_receiver(**sync_args) if make_receiver is not None
                    else ParameterReceiver(engine.parameters_for_sync(), staged=cfg.sync.stage_on_actors, **sync_args))
        push = ctx.socket(zmq.PUSH)
        if keys_dir:
            secure_client(push, keys_dir)
        push.setsockopt(zmq.LINGER, int(cfg.transport.timeout_s * 1000))
        push.setsockopt(zmq.SNDHWM, cfg.transport.hwm)  # learner stalls -> we block here, memory stays bounded
        push.setsockopt(zmq.SNDTIMEO, int(cfg.transport.timeout_s * 1000))
        push.connect(welcome.experience_addr)
        syncer = Syncer(hub, receiver, engine, state, spans)
        scorer = Scorer(rollout, push, state, spans, cfg.reward.in_flight)
        if cfg.sync.in_flight:
            engine.step_hook = InFlight(syncer, timeout_s=cfg.transport.timeout_s, poll_s=cfg.sync.in_flight_poll_s)
        log.info("actor %d ready (%s) on %s", actor_id, name, device)
        compiling = engine_cfg.name == "torch" and engine_cfg.compile
        while True:
            # Parameters left half-updated by a broken-off broadcast (unstaged receivers:
            # sync.stage_on_actors=false, vLLM) must not generate: ask for no prompts
            # (the hub answers Wait or SyncOrder) until a sync completes.
            wanted = cfg.actors.groups_per_request if receiver.intact else 0
            asked_us = now_us()
            try:
                reply = hub.request(WorkRequest(actor_id=actor_id, version=engine.version, max_groups=wanted))
            except TimeoutError:
                log.error("actor %d leaving: the hub did not answer for %.0fs", actor_id, cfg.transport.timeout_s)
                return 1
            if isinstance(reply, Wait):  # one wait-for-admission span until the hub grants or syncs
                waiting.waiting(since_us=asked_us)
                time.sleep(reply.seconds)
                continue
            waiting.done()
            if isinstance(reply, Goodbye) and reply.rejoin:
                scorer.drop_pending()
                actor_id = _register_again(hub, name, state)
                continue
            if isinstance(reply, Goodbye):
                log.info("actor %d leaving: %s", actor_id, reply.reason)
                return 0
            if isinstance(reply, SyncOrder):
                try:
                    if not syncer.follow(reply):
                        time.sleep(0.05)
                except LeaveNow as leave:
                    log.error("actor %d leaving: %s", actor_id, leave.why)
                    return leave.code
            elif isinstance(reply, EvalGrant):
                with spans.span("eval", groups=len(reply.prompt_ids)):
                    scorer.send(evaluate_chunk(rollout, reply, actor_id, cfg.eval.threads))
            elif isinstance(reply, WorkGrant):
                try:
                    generated = rollout.generate(reply, actor_id, spans)
                    if compiling:
                        log.info("actor %d: the first batch took %.1f s, compiling the blocks included "
                                 "(actors.engine.compile)", actor_id, generated.seconds)
                        compiling = False
                except LeaveNow as leave:  # only from the in-flight hook, in the middle of generation
                    if leave.rejoin:  # the grant was re-issued when the hub removed us: drop the batch
                        scorer.drop_pending()
                        actor_id = _register_again(hub, name, state)
                        continue
                    log.log(logging.INFO if leave.code == 0 else logging.ERROR, "actor %d leaving: %s", actor_id,
                            leave.why)
                    return leave.code
                scorer.score(generated)
    finally:
        # The heartbeat thread stops first, so that no heartbeat reaches the hub after the
        # goodbye (it would count as a message from an unknown actor; late spans do not).
        stop.set()
        beat.join(timeout=5)
        # The grant being scored reaches the hub before our goodbye re-issues it.
        stuck = scorer is not None and not scorer.close(wait_s=cfg.reward.timeout_s + 5)
        if stuck:
            log.warning("actor %d leaving with its scorer thread still at work after %.0fs (a push the hub does "
                        "not take); its groups are re-issued", actor_id, cfg.reward.timeout_s + 5)
        while len(spans):  # best effort, like the goodbye: the spans since the last heartbeat
            _ship_spans(hub.sock, actor_id, spans, flags=zmq.NOBLOCK)
        try:  # best effort: the hub re-issues our prompts now instead of after the heartbeat timeout
            send(hub.sock, Goodbye(reason="leaving", actor_id=actor_id), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        if push is not None and not stuck:  # a stuck thread's socket is its own (scoring.py)
            push.close()
        if rollout is not None and not stuck:
            rollout.close()
        hub.close(linger_ms=1000)  # lets the goodbye out
        if not stuck:  # term() would wait forever for the stuck thread's socket: the exit ends both
            ctx.term()


def _register_again(hub: HubClient, name: str, state: dict) -> int:
    """The hub removed us (silent past actors.heartbeat_timeout_s, e.g. a stopped process,
    or its connection to us closed) and re-issued our grants: register again, keeping
    the weights we hold (the next sync brings them up to date). Returns the new id."""
    welcome = hub.request(Hello(actor_name=name, pid=os.getpid(), host=socket.gethostname()))
    if not isinstance(welcome, Welcome):
        raise RuntimeError(f"the hub refused registration: {welcome}")
    log.warning("actor %d was removed by the hub; registered again as actor %d", state["actor_id"],
                welcome.actor_id)
    state["actor_id"] = welcome.actor_id
    return welcome.actor_id


def evaluate_chunk(rollout: Rollout, grant: EvalGrant, actor_id: int, threads: int | None = None) -> list:
    """Score one chunk of held-out prompts; the encoded EvalResult. In-flight weight
    updates are off meanwhile: every score of a round comes from the version it names.
    `threads`: torch intra-op threads while it runs (eval.threads)."""
    engine = rollout.engine
    hook, engine.step_hook = getattr(engine, "step_hook", None), None
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        scores = rollout.scores(list(grant.prompt_ids))
    finally:
        engine.step_hook = hook
        torch.set_num_threads(before)
    return encode(EvalResult(actor_id=actor_id, round=grant.round, version=grant.version,
                             prompt_ids=list(grant.prompt_ids), rewards=scores.rewards, response_lengths=scores.lengths,
                             truncated=scores.truncated, **scores.failures))
