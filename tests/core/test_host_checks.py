"""Host-side checks noted on moved tensors: a micro-batch moved from the CPU carries its mask check and its target
ranges, which tree attention's mask check and the log-prob kernel's range check use instead of reading the device
tensor back (a host sync); a changed, sliced or unnoted tensor is checked the slow way, and bad values still raise."""

from __future__ import annotations

import gc

import pytest
import torch
from scripts.logprobs_reference import BATCHES, micro_batches

from megatron_tree.attention.dispatch import check_subtree_end_values
from megatron_tree.core import host_checks
from megatron_tree.ops.logprobs import gather_tree_logprobs


def test_a_fact_holds_for_the_unmodified_tensor_only():
    t = torch.arange(1, 9)[None]
    host_checks.remember(t, interval_vector=True)
    host_checks.remember(t, value_range=(1, 8))
    assert host_checks.recall(t, "interval_vector") and host_checks.recall(t, "value_range") == (1, 8)
    assert host_checks.recall(t[:, :4], "interval_vector") is None and host_checks.recall(t.clone(), "value_range") is None
    t[0, 0] = 7  # an in-place edit
    assert host_checks.recall(t, "interval_vector") is None
    key = id(t)
    del t
    gc.collect()
    assert key not in host_checks._FACTS


def test_moving_a_micro_batch_notes_its_checks():
    (mb,) = micro_batches(BATCHES["multi_turn"], max_tokens=64)
    moved = mb.to("meta")  # any device but the CPU
    assert host_checks.recall(moved.attention_mask, "interval_vector")
    assert host_checks.recall(moved.logprob_labels, "value_range") == host_checks.value_range(mb.logprob_labels)
    assert host_checks.recall(moved.logprob_slots, "value_range") == host_checks.value_range(mb.logprob_slots)
    host_copy = host_checks.recall(moved.attention_mask, "host_copy")
    assert torch.equal(host_copy, mb.attention_mask) and host_copy.device.type == "cpu"
    assert host_copy.data_ptr() != mb.attention_mask.data_ptr()  # a copy: the caller's tensor may change later
    broken = mb.attention_mask.clone()
    broken[0, 3] = 2  # slot 3 ends before itself
    bad = type(mb)(**{**vars(mb), "attention_mask": broken}).to("meta")
    assert host_checks.recall(bad.attention_mask, "interval_vector") is None
    with pytest.raises(ValueError, match="not an interval vector"):
        check_subtree_end_values(broken)


def test_checks_use_the_noted_facts_and_still_refuse_bad_values():
    """The noted facts are what the checks read (a wrong note is believed: only TreeMicroBatch.to writes them)."""
    broken = torch.tensor([[2, 1, 3]])
    host_checks.remember(broken, interval_vector=True)
    check_subtree_end_values(broken)  # believed: not read back
    (mb,) = micro_batches(BATCHES["multi_turn"], max_tokens=64)
    logits = torch.randn(1, mb.num_slots, 11)
    gather_tree_logprobs(logits, mb)
    vocab_top = int(mb.logprob_labels.max())
    host_checks.remember(mb.logprob_labels, value_range=(0, 11))  # one past the vocabulary
    host_checks.remember(mb.logprob_slots, value_range=host_checks.value_range(mb.logprob_slots))
    with pytest.raises(ValueError, match=r"labels range over \[0, 11\]"):
        gather_tree_logprobs(logits, mb)
    assert vocab_top < 11


@pytest.mark.gpu  # needs CUDA
def test_a_moved_micro_batch_is_checked_without_a_host_sync():
    """On the GPU: the mask check and the log-prob range check of a micro-batch moved by ``TreeMicroBatch.to``
    run with CUDA's sync debug mode set to error."""
    (mb,) = micro_batches(BATCHES["multi_turn"], max_tokens=64)
    moved = mb.to("cuda")
    logits = torch.randn(1, mb.num_slots, 11, device="cuda")
    gather_tree_logprobs(logits, moved)  # its kernel's first compile syncs (alone, no earlier test compiled it)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        check_subtree_end_values(moved.attention_mask)
        gather_tree_logprobs(logits, moved)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(RuntimeError):  # the same check on an unnoted copy reads it back
        torch.cuda.set_sync_debug_mode("error")
        try:
            check_subtree_end_values(moved.attention_mask.clone())
        finally:
            torch.cuda.set_sync_debug_mode("default")
