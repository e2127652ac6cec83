"""An LLM judge as a reward source (`reward: judge`): a generative model asked, through a
prompt template, whether (or how well) a response answers its prompt, and its reply
parsed into a score.

The judge is a service behind an OpenAI-compatible chat-completions API (`url`: vLLM's,
SGLang's or a hosted model's server) or a causal LM directory (`model`) run greedily on
our torch engine, in the reward's worker or, with `placement: server`, in the reward
server, which judges a batch of questions in one generate call. The template gets
`{prompt}`, `{response}` and `{answer}`; the reply is parsed as a `verdict` (its first
word yes/no, correct/incorrect, true/false: 1 or 0) or a `score` (its first number). A
reply neither parser reads is unscorable (`not_a_number`), never a 0; a service that
stays unreachable or failing after its retries is unscorable too (`raised`), a service
that does not answer by the call's deadline fails as any slow call does. Replies are
cached by (prompt, response, answer, template) in each worker, so a response the policy
repeats is judged once. Each call's time is the component's latency in the metrics;
every LOG_EVERY calls the actor's log gets a line of the judge's time and reply tokens
per call and its cache hits.
"""
from __future__ import annotations

import json
import re
import sys
import time
from collections import OrderedDict
from pathlib import Path

from async_rl.rewards.outcome import Failed
from async_rl.rewards.remote import NoAnswer, Unavailable, post_json

JUDGE = "judge"  # a component's `reward` that means an LLM judge
DEFAULT_TEMPLATE = ("Question: {prompt}\nReference answer: {answer}\nResponse: {response}\n"
                    "Is the response correct? Answer yes or no.")
VERDICTS = {"yes": 1.0, "correct": 1.0, "true": 1.0, "no": 0.0, "incorrect": 0.0, "false": 0.0}
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
CACHE_SIZE = 4096
LOG_EVERY = 100  # calls asked between the judge's lines in the actor's log


def parse(reply: str, parser: str) -> float:
    """The score a judge's reply says; Failed (`not_a_number`) when it says none."""
    if parser == "verdict":
        words = re.findall(r"[a-z]+", reply.lower())
        if words and words[0] in VERDICTS:
            return VERDICTS[words[0]]
    else:
        number = NUMBER.search(reply)
        if number:
            return float(number.group())
    raise Failed("not_a_number", f"the judge's reply is unparsable as a {parser}: {reply.strip()[:80]!r}")


class Judge:
    def __init__(self, *, url: str | None = None, model: str | Path | None = None, served_model: str = "judge",
                 template: str = DEFAULT_TEMPLATE, parser: str = "verdict", max_tokens: int = 16,
                 timeout_s: float = 10.0, retries: int = 3, api_key: str | None = None, device: str = "cpu") -> None:
        if (url is None) == (model is None):
            raise ValueError("a judge is a `url` or a `model`, one of them")
        self.url = url.rstrip("/") + "/chat/completions" if url and not url.rstrip("/").endswith("/chat/completions") \
            else url
        self.served_model, self.template, self.parser, self.max_tokens = served_model, template, parser, max_tokens
        self.timeout_s, self.retries, self.api_key = timeout_s, retries, api_key
        self.cache: OrderedDict[tuple, float] = OrderedDict()
        self.calls = self.hits = self.tokens = 0
        self.seconds = 0.0
        self.local = None if model is None else _LocalJudge(model, device)

    def __call__(self, prompt: str, response: str, answer: str, **fields) -> float:
        score = self.score_batch([prompt], [response], [answer])[0]
        if isinstance(score, Failed):
            raise score
        return score

    def question(self, prompt: str, response: str, answer: str) -> str:
        return self.template.format(prompt=prompt, response=response, answer=answer)

    def count_tokens(self, prompt: str, response: str, answer: str = "") -> int:
        """The tokens of the question and its longest reply (what the reward server batches by)."""
        text = self.question(prompt, response, answer)
        return (len(self.local.tokenizer(text)["input_ids"]) if self.local else len(text) // 4) + self.max_tokens

    def score_batch(self, prompts: list[str], responses: list[str], answers: list[str] | None = None) -> list:
        """Per row, its score or the Failed that says why it has none: the cache's, else the
        judge's (a local model's in one generate call, a server's one request at a time)."""
        answers = answers if answers is not None else [""] * len(prompts)
        keys = [(p, r, a, self.template) for p, r, a in zip(prompts, responses, answers)]
        scores: list = [None] * len(keys)
        asked: dict[tuple, list[int]] = {}
        for i, key in enumerate(keys):
            if key in self.cache:
                self.hits += 1
                self.cache.move_to_end(key)
                scores[i] = self.cache[key]
            else:
                asked.setdefault(key, []).append(i)
        if not asked:
            return scores
        started = time.perf_counter()
        questions = [self.question(*key[:3]) for key in asked]
        try:
            if self.local is not None:
                replies = self.local.replies(questions, self.max_tokens)
                self.tokens += self.local.generated
            else:
                replies = [self._ask_or_fail(q) for q in questions]
        finally:
            self._count(time.perf_counter() - started, len(questions))
        for key, reply in zip(asked, replies):
            try:
                score = reply if isinstance(reply, Failed) else parse(reply, self.parser)
            except Failed as failure:
                score = failure
            if not isinstance(score, Failed):
                self.cache[key] = score
                if len(self.cache) > CACHE_SIZE:
                    self.cache.popitem(last=False)
            for i in asked[key]:
                scores[i] = score
        return scores

    def _ask_or_fail(self, question: str) -> str | Failed:
        try:
            return self._ask(question)
        except Failed as failure:
            return failure

    def _count(self, seconds: float, calls: int = 1) -> None:
        """Every LOG_EVERY calls asked, one line in the actor's log: the judge's time and
        tokens per call, and the share the cache answered."""
        before = self.calls
        self.calls, self.seconds = self.calls + calls, self.seconds + seconds
        if self.calls // LOG_EVERY > before // LOG_EVERY:
            print(f"judge: {self.calls} calls asked, {self.seconds / self.calls:.3f} s and "
                  f"{self.tokens / self.calls:.1f} reply tokens per call; {self.hits} more answered by the cache",
                  file=sys.stderr, flush=True)

    def _ask(self, question: str) -> str:
        body = {"model": self.served_model, "messages": [{"role": "user", "content": question}],
                "max_tokens": self.max_tokens, "temperature": 0.0}
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            answer = json.loads(post_json(self.url, body, time.monotonic() + self.timeout_s, self.retries,
                                          headers, what="judge"))
            self.tokens += int((answer.get("usage") or {}).get("completion_tokens") or 0)
            reply = answer["choices"][0]["message"]["content"]
        except NoAnswer as err:
            raise Failed("timeout", str(err)) from None
        except Unavailable as err:
            raise Failed("raised", str(err)) from None
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
            raise Failed("raised", f"judge at {self.url}: unreadable answer ({type(err).__name__}: {err})") from None
        if not isinstance(reply, str):
            raise Failed("not_a_number", f"judge at {self.url}: its reply is not text: {reply!r:.60}")
        return reply


class _LocalJudge:
    """A causal LM directory answering greedily on our torch engine, questions of a batch
    in one generate call, through its chat template when it has one."""

    def __init__(self, path: str | Path, device: str = "cpu") -> None:
        import torch
        from transformers import AutoTokenizer

        from async_rl.actor.engines import make_engine

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.engine = make_engine("torch", model_or_path=str(path), device=device, dtype=torch.float32)
        self.templated = bool(getattr(self.tokenizer, "chat_template", None))
        self.generated = 0

    def replies(self, questions: list[str], max_tokens: int) -> list[str]:
        if self.templated:
            texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                        add_generation_prompt=True) for q in questions]
            ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        else:
            ids = [self.tokenizer(q)["input_ids"] for q in questions]
        completions = self.engine.generate(ids, max_new_tokens=max_tokens, greedy=True)
        self.generated = sum(len(c[0]) for c in completions)
        return [self.tokenizer.decode(c[0].tokens.tolist(), skip_special_tokens=True) for c in completions]
