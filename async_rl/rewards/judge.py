"""An LLM judge as a reward source (`reward: judge`): a generative model asked, through a
prompt template, whether (or how well) a response answers its prompt, and its reply
parsed into a score.

The judge is a service behind an OpenAI-compatible chat-completions API (`url`: vLLM's,
SGLang's or a hosted model's server) or a causal LM directory (`model`) run greedily in
the reward's worker. The template gets `{prompt}`, `{response}` and `{answer}`; the
reply is parsed as a `verdict` (its first word yes/no, correct/incorrect, true/false:
1 or 0) or a `score` (its first number). A reply neither parser reads is unscorable
(`not_a_number`), never a 0; a service that stays unreachable or failing after its
retries is unscorable too (`raised`), a service that does not answer by the call's
deadline fails as any slow call does. Replies are cached by (prompt, response, answer,
template) in each worker, so a response the policy repeats is judged once. Each call's
time is the component's latency in the metrics; every LOG_EVERY calls the actor's log
gets a line of the judge's time and reply tokens per call and its cache hits.
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
                 timeout_s: float = 10.0, retries: int = 3, api_key: str | None = None) -> None:
        if (url is None) == (model is None):
            raise ValueError("a judge is a `url` or a `model`, one of them")
        self.url = url.rstrip("/") + "/chat/completions" if url and not url.rstrip("/").endswith("/chat/completions") \
            else url
        self.served_model, self.template, self.parser, self.max_tokens = served_model, template, parser, max_tokens
        self.timeout_s, self.retries, self.api_key = timeout_s, retries, api_key
        self.cache: OrderedDict[tuple, float] = OrderedDict()
        self.calls = self.hits = self.tokens = 0
        self.seconds = 0.0
        self.local = None if model is None else _LocalJudge(model)

    def __call__(self, prompt: str, response: str, answer: str, **fields) -> float:
        key = (prompt, response, answer, self.template)
        if key in self.cache:
            self.hits += 1
            self.cache.move_to_end(key)
            return self.cache[key]
        question = self.template.format(prompt=prompt, response=response, answer=answer)
        started = time.perf_counter()
        try:
            if self.local is not None:
                reply = self.local.reply(question, self.max_tokens)
                self.tokens += self.local.generated
            else:
                reply = self._ask(question)
        finally:
            self._count(time.perf_counter() - started)
        score = parse(reply, self.parser)
        self.cache[key] = score
        if len(self.cache) > CACHE_SIZE:
            self.cache.popitem(last=False)
        return score

    def _count(self, seconds: float) -> None:
        """Every LOG_EVERY calls asked, one line in the actor's log: the judge's time and
        tokens per call, and the share the cache answered."""
        self.calls, self.seconds = self.calls + 1, self.seconds + seconds
        if self.calls % LOG_EVERY == 0:
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
    """A causal LM directory answering greedily on this worker's one torch thread, through
    its chat template when it has one."""

    def __init__(self, path: str | Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.templated = bool(getattr(self.tokenizer, "chat_template", None))

    def reply(self, question: str, max_tokens: int) -> str:
        if self.templated:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                      add_generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")
        else:
            ids = self.tokenizer(question, return_tensors="pt")
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        with self.torch.inference_mode():
            out = self.model.generate(**ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
        self.generated = out.shape[1] - ids["input_ids"].shape[1]
        return self.tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
