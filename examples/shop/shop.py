"""A tool task of a user's own, written against the documented interfaces alone: a shop
whose prices the model cannot know. The customer buys a few of an invented item; the
policy must look its price up by writing <price>item</price> (the shop answers
<result>price</result>), then answer with the total. Reward 1 for the right total.

    python examples/shop/shop.py data/shop      # prompts.jsonl, eval.jsonl, demos.jsonl
    async-rl sft examples/shop/shop.yaml sft.data=data/shop/demos.jsonl run_dir=runs/shop-sft
    async-rl train examples/shop/shop.yaml model.path=runs/shop-sft/model

Without the warm start SmolLM2-135M-Instruct almost never writes the tag, and every
group scores 0 (docs/environments.md, "Starting a tool task from demonstrations").
Prices are a hash of the item's name, so the data and the environment agree without
sharing state.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import sys
from pathlib import Path

from async_rl import Turn

SYSTEM = ("You are a shop assistant. Prices are not known to you: look one up by writing "
          "<price>item</price>, and the shop answers with it. Then give the total as: Total: N")
SYLLABLES = ("bram", "quel", "tor", "vex", "lun", "drif", "mop", "zar", "kel", "fin", "wub", "sna", "plo", "grit")
CALL = re.compile(r"<price>\s*(.*?)\s*</price>", re.S)


def price(item: str) -> int:
    return 2 + int.from_bytes(hashlib.sha256(item.encode()).digest()[:4], "big") % 18


def items(count: int, seed: int) -> list[str]:
    rng, names = random.Random(seed), set()
    while len(names) < count:
        names.add("".join(rng.choice(SYLLABLES) for _ in range(2)))
    return sorted(names)


KNOWN = set(items(120, seed=0))


class Shop:
    """One customer, from the columns of the prompt's row (`item`, `quantity`): a turn
    that calls the tool gets a price, the first that does not is the answer, scored by
    its last number against quantity x price."""

    def __init__(self, prompt):
        self.total = int(prompt.fields["quantity"]) * price(prompt.fields["item"])

    def step(self, action: str) -> Turn:
        call = CALL.search(action)
        if call is not None:
            item = call.group(1).lower()
            known = item.rstrip("s") if item.rstrip("s") in KNOWN else item
            answer = str(price(known)) if known in KNOWN else "unknown item"
            return Turn([{"role": "user", "content": f"<result>{answer}</result>"}])
        numbers = re.findall(r"-?\d+", action)
        return Turn(reward=float(bool(numbers) and int(numbers[-1]) == self.total), done=True)


def make(prompt) -> Shop:
    return Shop(prompt)


def customer(rng: random.Random, item: str) -> tuple[list[dict], int, int]:
    quantity = rng.randint(2, 9)
    question = f"A customer buys {quantity} {item}s. How much do they pay?"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], quantity, \
        quantity * price(item)


def write(out: Path, prompts: int = 2000, held_out: int = 200, demos: int = 300, seed: int = 0) -> None:
    """Training and held-out prompts (held-out items never trained on), and demonstrations
    of the tool's use on the training items."""
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(KNOWN)
    random.Random(seed).shuffle(names)
    train_items, eval_items = names[:100], names[100:]
    rng = random.Random(seed)
    for path, pool, count in ((out / "prompts.jsonl", train_items, prompts),
                              (out / "eval.jsonl", eval_items, held_out)):
        with open(path, "w") as f:
            for _ in range(count):
                item = rng.choice(pool)
                messages, quantity, total = customer(rng, item)
                f.write(json.dumps({"messages": messages, "answer": str(total), "item": item,
                                    "quantity": quantity}) + "\n")
    with open(out / "demos.jsonl", "w") as f:
        for _ in range(demos):
            item = rng.choice(train_items)
            messages, quantity, total = customer(rng, item)
            # The call names the item as the question does: copying generalizes to new names.
            messages += [{"role": "assistant", "content": f"<price>{item}s</price>"},
                         {"role": "user", "content": f"<result>{price(item)}</result>"},
                         {"role": "assistant", "content": f"{quantity} x {price(item)} = {total}. Total: {total}"}]
            f.write(json.dumps({"messages": messages}) + "\n")


if __name__ == "__main__":
    write(Path(sys.argv[1] if len(sys.argv) > 1 else "data/shop"))
