"""A JSON request to a remote scorer (a sandbox service, a judge behind an
OpenAI-compatible API), within a deadline: connection errors and HTTP 5xx and 429
answers are retried with exponential backoff while the deadline allows; a timeout never
is (the service may still be working on it), nor is a 4xx. Standard library only.
"""
from __future__ import annotations

import http.client
import json
import random
import time
import urllib.error
import urllib.request

MAX_ANSWER_BYTES = 64 << 20
FIRST_BACKOFF_S = 0.1


class Unavailable(Exception):
    """The service refused, stayed unreachable or failing, or answered what cannot be read."""


class NoAnswer(TimeoutError):
    """No answer before the deadline (never retried)."""


def post_json(url: str, body: dict, deadline: float, retries: int, headers: dict | None = None,
              what: str = "service") -> bytes:
    """The answer's body to POST `body` at `url`, by `deadline` (time.monotonic());
    Unavailable or NoAnswer, each naming the service (`what`) and how it failed."""
    data = json.dumps(body).encode("utf-8")
    backoff, problem = FIRST_BACKOFF_S, ""
    for attempt in range(1, retries + 2):
        remaining = deadline - time.monotonic()
        if remaining <= 0:  # spent on earlier attempts and their backoff
            raise Unavailable(f"{what} at {url} {problem} (after {attempt - 1} attempts, until the deadline)")
        request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                                  **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=remaining) as response:
                answer = response.read(MAX_ANSWER_BYTES + 1)
                if len(answer) <= MAX_ANSWER_BYTES and response.length:  # read(n) ends early without raising
                    raise http.client.IncompleteRead(answer, response.length)
        except urllib.error.HTTPError as err:
            err.close()
            if err.code < 500 and err.code != 429:
                raise Unavailable(f"{what} at {url} refused the request: HTTP {err.code}") from None
            problem = f"failed: HTTP {err.code}"
        except urllib.error.URLError as err:
            if isinstance(err.reason, TimeoutError):
                raise NoAnswer(f"{what}: no answer within {remaining:.1f} s") from None
            problem = f"unreachable: {err.reason}"
        except TimeoutError:
            raise NoAnswer(f"{what}: no answer within {remaining:.1f} s") from None
        except OSError as err:  # reset or closed mid-answer
            problem = f"unreachable: {err}"
        except http.client.HTTPException as err:  # a malformed or cut-off answer
            problem = f"failed: {type(err).__name__}: {err}"
        else:
            if len(answer) > MAX_ANSWER_BYTES:
                raise Unavailable(f"{what}: answer beyond {MAX_ANSWER_BYTES} bytes")
            return answer
        if attempt <= retries:
            time.sleep(max(0.0, min(backoff * random.uniform(0.5, 1.5), deadline - time.monotonic())))
            backoff *= 2
    raise Unavailable(f"{what} at {url} {problem} (after {retries + 1} attempts)")
