"""Which hits are audited, and when two entries count as the same."""

from __future__ import annotations

import pytest
import torch

from actcache.errors import ConfigError
from actcache_client.engine._audit import AuditConfig, Auditor, same_entry, tolerances
from actcache_client.transport._tensors import VarLen, encode_samples


def test_first_samples_after_a_restart_then_one_in_every():
    auditor = Auditor(AuditConfig(first_samples=3, every=10, group=1))
    assert auditor.choose(2) == [0, 1]
    assert auditor.choose(4) == [0]  # the third first sample
    # 6 hits counted so far: the 10th hit is position 3 of the next batch of 5, the 20th position 3 of the one after
    assert auditor.choose(5) == [3]
    assert auditor.choose(5) == []
    assert auditor.choose(14) == [3, 13]
    auditor.restart()
    assert auditor.choose(5) == [0, 1, 2]


def test_periodic_audits_come_in_groups_of_consecutive_hits_across_batches():
    auditor = Auditor(AuditConfig(first_samples=2, every=10, group=4))
    # a period of 40 hits ends with its 4 audited hits: 36..39, then 76..79
    assert auditor.choose(30) == [0, 1]
    assert auditor.choose(8) == [6, 7]  # hits 36 and 37
    assert auditor.choose(5) == [0, 1]  # hits 38 and 39 (the group goes on into the next batch)
    assert auditor.choose(40) == [33, 34, 35, 36]  # hits 76..79


@pytest.mark.parametrize("group", [1, 8])
def test_the_periodic_share_is_exact_over_many_batches(group):
    auditor = Auditor(AuditConfig(first_samples=0, every=1000, group=group))
    assert sum(len(auditor.choose(128)) for _ in range(1000)) == 128


def test_every_zero_audits_only_the_first_samples_and_config_is_validated():
    auditor = Auditor(AuditConfig(first_samples=2, every=0))
    assert auditor.choose(10) == [0, 1] and auditor.choose(10) == []
    with pytest.raises(ConfigError):
        AuditConfig(every=-1)
    with pytest.raises(ConfigError, match="group"):
        AuditConfig(group=0)


def one(x: torch.Tensor, varlen=None) -> bytes:
    return encode_samples(x.unsqueeze(0) if varlen is None else x, varlen=varlen)[0]


def test_same_entry_tolerates_kernel_noise_not_other_values():
    x = torch.randn(4, 8)
    assert same_entry(one(x), one(x + 1e-6))
    assert not same_entry(one(x), one(x * 1.1))
    assert not same_entry(one(x), one(torch.randn(4, 8)))
    assert not same_entry(one(x), one(x[:3]))  # another shape
    assert not same_entry(one(x), one(x.half()))  # another dtype
    assert same_entry(one(x.half()), one((x + 1e-4).half()))
    ints = torch.arange(6)
    assert same_entry(one(ints), one(ints)) and not same_entry(one(ints), one(ints + 1))


@pytest.fixture
def tf32(request):
    """Sets PyTorch's TF32 flags (readable without a GPU) for one test."""
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = request.param
    torch.set_float32_matmul_precision("high" if request.param else "highest")
    yield request.param
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


@pytest.mark.parametrize("tf32", [True, False], indirect=True)
def test_float32_computed_in_tf32_on_cuda_gets_the_10_bit_mantissa_tolerance(tf32):
    x = torch.randn(4, 8)
    drifted = x + 5e-3 * x.abs().max()  # what TF32 kernels of another batch size can give
    cuda = tolerances(torch.device("cuda"))
    assert same_entry(one(x), one(drifted), cuda) == tf32
    assert not same_entry(one(x), one(drifted), tolerances(torch.device("cpu")))  # CPU: fp32 stays strict
    assert not same_entry(one(x), one(x * 1.1), cuda)  # other values are still far off
    assert not same_entry(one(x), one(torch.randn(4, 8)), cuda)


def test_same_entry_on_unpadded_text_states():
    hidden, mask = torch.randn(1, 5, 4), torch.tensor([[1, 1, 1, 0, 0]])
    assert same_entry(one((hidden, mask), VarLen()), one((hidden.clone(), mask), VarLen()))
    longer = torch.tensor([[1, 1, 1, 1, 0]])
    assert not same_entry(one((hidden, mask), VarLen()), one((hidden, longer), VarLen()))
