"""A reply offered to a streaming fold after the round's deadline fails as a call failure."""
import pytest
import torch

from fedhop.common.processors.streaming import OrderedFold
from fedhop.common.transport.base import CallFailed
from fedhop.common.transport.fabric import CALL_ERRORS, _folded
from fedhop.common.wire.message import Payload


def test_late_reply_is_a_call_failure() -> None:
    fold = OrderedFold([1, 2], {})
    fold.close()   # the deadline: key 1's reply comes after it
    with pytest.raises(CallFailed, match="came after the round's deadline") as caught:
        _folded(fold, 1, Payload(scalars={"weight": 1.0}))
    assert isinstance(caught.value, CALL_ERRORS)   # `gather` files it as the key's failure
    assert fold.folded == []


def test_reply_in_time_keeps_its_scalars_only() -> None:
    fold = OrderedFold([1], {})
    kept = _folded(fold, 1, Payload(tensors={"w": torch.ones(3)}, scalars={"weight": 2.0}))
    assert kept.tensors == {} and kept.scalars == {"weight": 2.0}
    assert fold.folded == [1]
