"""NodeStableSampler: node shards fixed across epochs, equal lengths, minimal re-sharding, resume on other layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import actcache_client as ac
from actcache.errors import ConfigError
from actcache_client.sampler import DEFAULT_CANONICAL_NODES, NodeStableSampler, node_assignment


def world(n: int, nodes: int, ranks: int, **options) -> list[list[NodeStableSampler]]:
    """Samplers of every rank: world[node][local_rank]."""
    return [[NodeStableSampler(n, num_nodes=nodes, node_rank=node, local_world_size=ranks, local_rank=r, **options)
             for r in range(ranks)] for node in range(nodes)]


def orders(samplers: list[list[NodeStableSampler]], epoch: int) -> list[list[list[int]]]:
    for node in samplers:
        for s in node:
            s.set_epoch(epoch)
    return [[list(s) for s in node] for node in samplers]


LAYOUTS = [(100, 2, 2), (103, 2, 3), (97, 3, 2), (50, 4, 3), (1000, 7, 2), (64, 1, 1)]


@pytest.mark.parametrize("n,nodes,ranks", LAYOUTS)
def test_each_epoch_covers_the_dataset_once_and_repeats_only_a_ranks_own_samples(n, nodes, ranks):
    samplers = world(n, nodes, ranks)
    for epoch in range(3):
        got = orders(samplers, epoch)
        lengths = {len(o) for node in got for o in node}
        assert lengths == {len(samplers[0][0])}  # every rank of every node: the same length
        firsts = [set(o) for node in got for o in node]
        assert set().union(*firsts) == set(range(n))  # complete
        assert sum(len(f) for f in firsts) == n  # disjoint: ranks and nodes never share a sample
        yielded = sum(len(o) for node in got for o in node)
        assert yielded - n == samplers[0][0].padding < nodes * ranks  # repeats: fewer than one per rank
        for node, shard_orders in enumerate(got):
            assert set().union(*map(set, shard_orders)) == set(samplers[node][0].node_shard().tolist())


@pytest.mark.parametrize("n,nodes,ranks", LAYOUTS)
def test_drop_last_gives_every_rank_the_smallest_share_and_no_repeats(n, nodes, ranks):
    samplers = world(n, nodes, ranks, drop_last=True)
    smallest = min(len(s.node_shard()) for s in (node[0] for node in samplers)) // ranks
    got = orders(samplers, 1)
    assert {len(o) for node in got for o in node} == {smallest}
    flat = [i for node in got for o in node for i in o]
    assert len(flat) == len(set(flat)) and len(flat) + samplers[0][0].padding == n


def test_shards_are_balanced_and_fixed_across_epochs_while_their_order_changes():
    samplers = world(1000, 4, 2)
    sizes = [len(node[0].node_shard()) for node in samplers]
    assert sum(sizes) == 1000 and max(sizes) - min(sizes) <= 2
    per_epoch = [orders(samplers, e) for e in range(3)]
    for node in range(4):
        shard = set(samplers[node][0].node_shard().tolist())
        for got in per_epoch:
            assert set(got[node][0]) | set(got[node][1]) == shard
    assert per_epoch[0][0][0] != per_epoch[1][0][0]  # reshuffled within the node
    # which local rank gets a sample changes between epochs too (the node's shard is split anew)
    assert set(per_epoch[0][0][0]) != set(per_epoch[1][0][0])


def test_the_order_is_a_function_of_seed_and_epoch_only():
    a = NodeStableSampler(200, num_nodes=2, node_rank=1, local_world_size=2, local_rank=1, seed=7)
    b = NodeStableSampler(200, num_nodes=2, node_rank=1, local_world_size=2, local_rank=1, seed=7)
    a.set_epoch(5)
    first = list(a)
    assert list(a) == first  # drawing the same epoch twice
    b.set_epoch(4)
    list(b)
    b.set_epoch(5)
    assert list(b) == first
    a.set_epoch(6)
    assert list(a) != first
    c = NodeStableSampler(200, num_nodes=2, node_rank=1, local_world_size=2, local_rank=1, seed=8)
    c.set_epoch(5)
    assert list(c) != first
    unshuffled = NodeStableSampler(200, num_nodes=2, node_rank=1, local_world_size=2, local_rank=1, shuffle=False)
    assert list(unshuffled) == sorted(unshuffled) and list(unshuffled) == unshuffled.node_shard()[1::2].tolist()


@pytest.mark.parametrize("before,after", [(2, 1), (2, 4), (4, 2), (2, 3), (3, 2), (4, 8), (8, 6), (16, 12)])
def test_re_sharding_keeps_the_largest_possible_share_on_the_nodes_both_runs_have(before, after):
    n = 12_000
    old, new = node_assignment(n, before), node_assignment(n, after)
    kept = float(np.mean(old == new))
    # Only the nodes both runs have can keep data: min/max of it is the most any placement keeps.
    best = min(before, after) / max(before, after)
    assert best - 0.002 <= kept <= best + 0.002
    # A sample that moves goes to a node the smaller run does not have.
    moved = old != new
    assert np.all((new[moved] >= before) if after > before else (old[moved] >= after))


def test_the_canonical_grouping_never_depends_on_the_node_count():
    # Canonical nodes move whole: samples sharing a node at 120 nodes share one at every smaller count.
    n, c = 5000, 120
    finest = node_assignment(n, c, num_canonical_nodes=c)
    for nodes in (1, 2, 3, 5, 8, 60):
        coarse = node_assignment(n, nodes, num_canonical_nodes=c)
        for group in range(c):
            assert len(set(coarse[finest == group].tolist())) == 1


def test_blocks_of_consecutive_indices_stay_together():
    nodes = node_assignment(1000, 4, block_size=50)
    for start in range(0, 1000, 50):
        assert len(set(nodes[start:start + 50].tolist())) == 1
    assert sorted(np.bincount(nodes).tolist()) == [250, 250, 250, 250]


def test_resume_on_the_same_layout_continues_each_ranks_order():
    samplers = world(120, 2, 2)
    full = orders(samplers, 3)
    state = samplers[0][0].state_dict(consumed=10)
    assert state["epoch"] == 3 and state["seen"] is not None
    samplers[0][0].set_epoch(4)  # as CachedLoader does halfway through epoch 3
    assert samplers[0][0].state_dict(consumed=10, epoch=3) == state
    resumed = world(120, 2, 2)
    for node in resumed:
        for s in node:
            s.load_state_dict(state)
            assert s.epoch == 3 and len(s) == len(full[0][0]) - 10
    got = [[list(s) for s in node] for node in resumed]
    assert got == [[o[10:] for o in node] for node in full]
    after = orders(resumed, 4)
    assert after == orders(world(120, 2, 2), 4)  # later epochs are whole again


@pytest.mark.parametrize("layout", [(1, 1), (1, 2), (4, 1), (3, 2)])
def test_resume_on_another_layout_visits_exactly_the_unseen_samples(layout):
    n = 130
    samplers = world(n, 2, 2)
    full = orders(samplers, 2)
    seen = {i for node in full for o in node for i in o[:12]}
    state = samplers[1][1].state_dict(consumed=12)  # any rank's state is the same
    assert state == samplers[0][0].state_dict(consumed=12)
    nodes, ranks = layout
    resumed = world(n, nodes, ranks)
    for node in resumed:
        for s in node:
            s.load_state_dict(state)
    got = [[list(s) for s in node] for node in resumed]
    assert len({len(o) for node in got for o in node}) == 1  # equal lengths on the new layout too
    firsts = [set(o) for node in got for o in node]
    assert set().union(*firsts) == set(range(n)) - seen and sum(map(len, firsts)) == n - len(seen)
    # each resumed sample is on its node under the new placement
    placement = node_assignment(n, nodes)
    assert all(placement[i] == node for node, shard in enumerate(got) for o in shard for i in o)
    # a checkpoint of the resumed epoch still knows what the first run saw
    again = resumed[0][0].state_dict(consumed=1)
    twice = {i for node in got for o in node for i in o[:1]} | seen
    assert set(np.flatnonzero(np.unpackbits(np.frombuffer(again["seen"], np.uint8), count=n)).tolist()) == twice


def test_a_state_at_the_end_of_an_epoch_resumes_at_the_next_one():
    s = NodeStableSampler(40, num_nodes=2, node_rank=0, local_world_size=2, local_rank=0, drop_last=True)
    s.set_epoch(1)
    state = s.state_dict(consumed=len(s))
    assert state["epoch"] == 2 and state["seen"] is None
    with pytest.raises(ConfigError, match="40 samples, this sampler.s has 41"):
        NodeStableSampler(41, num_nodes=1, node_rank=0, local_world_size=1, local_rank=0).load_state_dict(state)


def test_the_layout_comes_from_torchruns_environment(monkeypatch):
    for name, value in {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "LOCAL_RANK": "3"}.items():
        monkeypatch.setenv(name, value)
    s = NodeStableSampler(100)
    assert (s.num_nodes, s.node_rank, s.local_world_size, s.local_rank) == (2, 1, 4, 3)
    assert NodeStableSampler(100, num_nodes=4, node_rank=3).num_nodes == 4  # arguments win
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ConfigError, match="not a multiple of 4 ranks per node"):
        NodeStableSampler(100)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("GROUP_RANK", "2")
    with pytest.raises(ConfigError, match="node rank 2 is outside 0..1"):
        NodeStableSampler(100)
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name)
    alone = NodeStableSampler(10)
    assert (alone.num_nodes, alone.local_world_size, len(alone)) == (1, 1, 10)


def test_more_nodes_than_canonical_nodes_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="raise num_canonical_nodes"):
        node_assignment(1000, 9, num_canonical_nodes=8)
    with pytest.raises(ConfigError, match="only 5 canonical nodes"):
        node_assignment(5, 6)  # a dataset smaller than the canonical count uses one per sample
    assert DEFAULT_CANONICAL_NODES % 256 == 0 and DEFAULT_CANONICAL_NODES % 120 == 0


def _loader(sampler: NodeStableSampler, model=None) -> ac.CachedLoader:
    g = torch.Generator().manual_seed(0)
    data = ac.IndexedDataset(TensorDataset(torch.randn(90, 4, generator=g), torch.zeros(90)))
    return ac.CachedLoader(DataLoader(data, batch_size=8, sampler=sampler), model)


def test_cached_loader_draws_each_epoch_from_the_sampler_also_ahead_of_time():
    model = ac.CachedForward(ac.from_sequential(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))))
    sampler = NodeStableSampler(90, num_nodes=2, node_rank=1, local_world_size=2, local_rank=0, seed=3)
    loader = _loader(sampler, model)  # with a model the next epoch is drawn halfway through the current one
    reference = NodeStableSampler(90, num_nodes=2, node_rank=1, local_world_size=2, local_rank=0, seed=3)
    for epoch in range(3):
        loader.set_epoch(epoch)
        got = [i for batch in loader for i in batch.ids.tolist()]
        reference.set_epoch(epoch)
        assert got == list(reference)
    assert len(reference) == 23 and len(loader) == 3  # 45 samples per node, 23 per rank (one repeat)


def test_exported_from_the_package():
    assert ac.NodeStableSampler is NodeStableSampler
