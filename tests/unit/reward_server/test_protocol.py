import msgspec
import pytest

from async_rl.reward_server import protocol


def test_a_request_round_trips_and_a_bad_one_is_named():
    request = protocol.ScoreRequest(7, "rm", ["p"], ["r"], ["a"], 5.0)
    assert protocol.decode_request(protocol.encode(request)) == request
    with pytest.raises(protocol.BadRequest, match="not a score request") as err:
        protocol.decode_request(b"\x93garbage")
    assert err.value.request_id is None
    uneven = msgspec.msgpack.encode({"id": 3, "component": "rm", "prompts": ["p", "q"], "responses": ["r"],
                                     "answers": ["a"], "timeout_s": 1.0})
    with pytest.raises(protocol.BadRequest, match="differ in length") as err:
        protocol.decode_request(uneven)
    assert err.value.request_id == 3
    extra = msgspec.msgpack.encode({"id": 4, "component": "rm", "prompts": [], "responses": [], "answers": [],
                                    "timeout_s": 1.0, "pickle": b"x"})
    with pytest.raises(protocol.BadRequest) as err:
        protocol.decode_request(extra)
    assert err.value.request_id == 4
