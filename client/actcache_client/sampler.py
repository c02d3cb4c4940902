"""Each sample stays on one node: a node's daemon is asked only for what its own ranks computed.

With a ``DistributedSampler`` a sample lands on another node almost every epoch, so on N nodes about (N-1)/N
of lookups miss and every node ends up storing the whole dataset. ``NodeStableSampler`` splits the dataset
once into one shard per node, shuffles each shard every epoch and splits it among the node's local ranks.

Placement (``node_assignment``), as in mosaicml/streaming's canonical nodes: samples (or blocks of
``block_size`` indices) are dealt into ``num_canonical_nodes`` groups by a seeded permutation, whatever the
number of nodes; for P physical nodes the placement is built from the one for P-1: every node keeps its first
quota (``C // P`` canonical nodes, one more for the first ``C % P``) and the new node P-1 takes the rest. So
between runs on P and P' nodes exactly ``min(P, P') / max(P, P')`` of the data stays on the node that cached
it, the most any placement can keep (streaming's ``c % P`` striping keeps as much only when one count divides
the other). ``DEFAULT_CANONICAL_NODES`` = 3840 = 2^8 * 3 * 5, so most node counts get equal shares; a large
count costs nothing in shuffle quality (each node shuffles its whole shard).

Every rank yields the same number of samples per epoch (DDP must not hang on uneven shards): shorter ranks
repeat their own samples (``drop_last=False``) or longer ones drop their tail. ``state_dict`` records which
samples an epoch has seen; ``load_state_dict`` on another number of nodes or ranks visits exactly the unseen
ones in the rest of that epoch, each on its node under the new placement.
"""

from __future__ import annotations

import itertools
import os
from typing import Any, Iterator, Sized

import numpy as np
import torch
from torch.utils.data import Sampler

from actcache.errors import ConfigError

__all__ = ["DEFAULT_CANONICAL_NODES", "NodeStableSampler", "node_assignment"]

DEFAULT_CANONICAL_NODES = 3840

# Independent random streams derived from the one seed.
_BLOCKS, _SENIORITY, _EPOCH = 0, 1, 2


def _canonical_groups(num_samples: int, num_canonical_nodes: int, seed: int, block_size: int) -> tuple[np.ndarray, int]:
    """(canonical node of every index, number of canonical nodes used)."""
    blocks = -(-num_samples // block_size)
    used = min(num_canonical_nodes, blocks)
    position = np.argsort(np.random.default_rng([seed, _BLOCKS]).permutation(blocks))  # of each block in the deal
    of_block = position * used // blocks
    return of_block[np.arange(num_samples) // block_size], used


def _place_canonical(count: int, num_nodes: int, seed: int) -> np.ndarray:
    """Physical node of each of ``count`` canonical nodes, built up one node at a time (module docstring)."""
    seniority = np.random.default_rng([seed, _SENIORITY]).permutation(count)  # a node's list is in this order
    owner = np.zeros(count, dtype=np.int64)
    position = seniority.copy()  # place in its node's list
    for nodes in range(2, num_nodes + 1):
        base, extra = divmod(count, nodes)
        quota = base + (np.arange(nodes - 1) < extra)
        moving = np.flatnonzero(position >= quota[owner])
        moving = moving[np.argsort(seniority[moving], kind="stable")]
        owner[moving] = nodes - 1
        position[moving] = np.arange(len(moving))
    return owner


def node_assignment(num_samples: int, num_nodes: int, *, num_canonical_nodes: int = DEFAULT_CANONICAL_NODES,
                    seed: int = 0, block_size: int = 1) -> np.ndarray:
    """The node (0..num_nodes-1) holding each dataset index, for ``num_nodes`` physical nodes.

    Args:
        num_samples: The dataset's length.
        num_nodes: The number of physical nodes.
        num_canonical_nodes: The groups samples are dealt into, whatever the number of nodes.
        seed: Seeds the deal.
        block_size: Indices dealt together.

    Returns:
        The node of each dataset index.

    Raises:
        ConfigError: An empty dataset, an argument out of range, or more nodes than canonical nodes used.
    """
    if num_samples < 1:
        raise ConfigError(f"cannot place an empty dataset ({num_samples} samples) on nodes")
    for name, value, least in (("num_nodes", num_nodes, 1), ("num_canonical_nodes", num_canonical_nodes, 1),
                               ("block_size", block_size, 1), ("seed", seed, 0)):
        if value < least:
            raise ConfigError(f"{name} must be >= {least}, got {value}")
    canonical, used = _canonical_groups(num_samples, num_canonical_nodes, seed, block_size)
    if num_nodes > used:
        raise ConfigError(
            f"{num_nodes} nodes but only {used} canonical nodes ({num_samples} samples in blocks of {block_size}, "
            f"num_canonical_nodes={num_canonical_nodes}): every node needs one; raise num_canonical_nodes "
            "(a multiple of the node counts you use) or lower block_size")
    return _place_canonical(used, num_nodes, seed)[canonical]


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"${name}={value!r} is not an integer (torchrun sets it to one)") from None


def _layout(num_nodes: int | None, node_rank: int | None, local_world_size: int | None,
            local_rank: int | None) -> tuple[int, int, int, int]:
    """(nodes, node rank, ranks per node, local rank): the arguments, else torchrun's environment, else one process."""
    local_world_size = local_world_size if local_world_size is not None else _env_int("LOCAL_WORLD_SIZE") or 1
    local_rank = local_rank if local_rank is not None else _env_int("LOCAL_RANK") or 0
    if num_nodes is None:
        world = _env_int("WORLD_SIZE")
        if world is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            world = torch.distributed.get_world_size()
        world = world or local_world_size
        if world % local_world_size:
            raise ConfigError(f"world size {world} is not a multiple of {local_world_size} ranks per node: "
                              "every node must run the same number of ranks (torchrun --nproc-per-node)")
        num_nodes = world // local_world_size
    if node_rank is None:
        node_rank = _env_int("GROUP_RANK")
        if node_rank is None:
            rank = _env_int("RANK")
            node_rank = rank // local_world_size if rank is not None else 0
    if num_nodes < 1 or local_world_size < 1:
        raise ConfigError(f"need >= 1 node and >= 1 rank per node, got {num_nodes} nodes of {local_world_size} ranks")
    if not 0 <= node_rank < num_nodes:
        raise ConfigError(f"node rank {node_rank} is outside 0..{num_nodes - 1} ({num_nodes} nodes)")
    if not 0 <= local_rank < local_world_size:
        raise ConfigError(f"local rank {local_rank} is outside 0..{local_world_size - 1} "
                          f"({local_world_size} ranks per node)")
    return num_nodes, node_rank, local_world_size, local_rank


class NodeStableSampler(Sampler[int]):
    """Dataset indices for this rank: its node's fixed shard, shuffled per epoch, split among the node's
    ranks.

    The layout comes from the arguments, else torchrun's ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``GROUP_RANK`` and ``LOCAL_RANK``, else a single process. Call ``set_epoch`` every epoch (CachedLoader
    does it when it draws an epoch's order; drawing an epoch twice gives the same order).

    Invariants, every epoch: all ranks of all nodes yield ``len(self)`` samples; a node's ranks are disjoint
    except for padding repeats; with ``drop_last=False`` every sample is yielded at least once; a node's shard
    is the same every epoch.

    Args:
        data_source: The dataset (or its length).
        num_nodes: The number of nodes.
        node_rank: This node's rank.
        local_world_size: Ranks per node.
        local_rank: This rank's index on its node.
        num_canonical_nodes: The groups samples are dealt into (``node_assignment``).
        seed: Seeds the placement and the shuffles.
        shuffle: Shuffle each shard every epoch.
        drop_last: Longer ranks drop their tail; else shorter ranks repeat their own samples.
        block_size: Indices placed together (``node_assignment``).
    """

    def __init__(self, data_source: Sized | int, *, num_nodes: int | None = None, node_rank: int | None = None,
                 local_world_size: int | None = None, local_rank: int | None = None,
                 num_canonical_nodes: int = DEFAULT_CANONICAL_NODES, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, block_size: int = 1) -> None:
        super().__init__()
        self.num_samples_total = data_source if isinstance(data_source, int) else len(data_source)
        self.num_nodes, self.node_rank, self.local_world_size, self.local_rank = _layout(
            num_nodes, node_rank, local_world_size, local_rank)
        self.num_canonical_nodes = num_canonical_nodes
        self.seed, self.shuffle, self.drop_last, self.block_size = seed, shuffle, drop_last, block_size
        self.epoch = 0
        self._node_of = node_assignment(self.num_samples_total, self.num_nodes, num_canonical_nodes=num_canonical_nodes,
                                        seed=seed, block_size=block_size)
        order = np.argsort(self._node_of, kind="stable")
        self._counts = np.bincount(self._node_of, minlength=self.num_nodes)
        self._shards = np.split(order, np.cumsum(self._counts)[:-1])
        self._resume: tuple[int, np.ndarray] | None = None  # (epoch, seen mask) of a mid-epoch resume

    def node_shard(self, node: int | None = None) -> np.ndarray:
        """The dataset indices of a node's shard, ascending.

        Args:
            node: The node; default: this rank's.
        """
        return self._shards[self.node_rank if node is None else node]

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch whose order the sampler yields.

        Args:
            epoch: The epoch.
        """
        self.epoch = epoch

    def _seen(self, epoch: int) -> np.ndarray | None:
        return self._resume[1] if self._resume is not None and self._resume[0] == epoch else None

    def _length(self, seen: np.ndarray | None) -> int:
        counts = self._counts if seen is None else np.bincount(self._node_of[~seen], minlength=self.num_nodes)
        n = self.local_world_size
        return int(counts.min()) // n if self.drop_last else -(-int(counts.max()) // n)

    def _rank_order(self, epoch: int, node: int, local_rank: int, seen: np.ndarray | None, length: int) -> np.ndarray:
        shard = self._shards[node]
        if self.shuffle:
            shard = shard[np.random.default_rng([self.seed, _EPOCH, epoch, node]).permutation(len(shard))]
        pool = shard if seen is None else shard[~seen[shard]]  # a resume keeps the epoch's order
        mine = pool[local_rank:: self.local_world_size]
        if len(mine) >= length:
            return mine[:length]
        source = mine if len(mine) else pool if len(pool) else shard  # repeat its own samples first
        return np.concatenate([mine, np.resize(source, length - len(mine))])

    def __iter__(self) -> Iterator[int]:
        seen = self._seen(self.epoch)
        order = self._rank_order(self.epoch, self.node_rank, self.local_rank, seen, self._length(seen))
        return iter(order.tolist())

    def __len__(self) -> int:
        return self._length(self._seen(self.epoch))

    @property
    def padding(self) -> int:
        """Samples all ranks together repeat this epoch (``drop_last=False``) or leave out (``drop_last=True``)."""
        seen = self._seen(self.epoch)
        remaining = self.num_samples_total if seen is None else int((~seen).sum())
        return abs(len(self) * self.num_nodes * self.local_world_size - remaining)

    def state_dict(self, consumed: int = 0, *, epoch: int | None = None) -> dict[str, Any]:
        """The state after every rank took ``consumed`` samples of ``epoch`` (the same count on every rank).

        With a CachedLoader, which draws the next epoch's order (``set_epoch(e + 1)``) halfway through epoch
        e, pass the epoch: ``state_dict(consumed=(batch.position + 1) * batch_size, epoch=batch.epoch)`` after
        the step of ``batch``.

        Args:
            consumed: Samples each rank took.
            epoch: The epoch; default: the last ``set_epoch``.

        Raises:
            ConfigError: ``consumed`` is negative.
        """
        if consumed < 0:
            raise ConfigError(f"consumed must be >= 0 samples, got {consumed}")
        epoch = self.epoch if epoch is None else epoch
        seen = self._seen(epoch)
        length = self._length(seen)
        if consumed >= length:  # the epoch is over
            epoch, seen, consumed = epoch + 1, None, 0
        if consumed:
            seen = np.zeros(self.num_samples_total, dtype=bool) if seen is None else seen.copy()
            for node, rank in itertools.product(range(self.num_nodes), range(self.local_world_size)):
                seen[self._rank_order(epoch, node, rank, self._seen(epoch), length)[:consumed]] = True
        return {"epoch": epoch, "num_samples": self.num_samples_total,
                "seen": None if seen is None else np.packbits(seen).tobytes(),
                # for the record: the layout and placement that produced it
                "num_nodes": self.num_nodes, "local_world_size": self.local_world_size,
                "num_canonical_nodes": self.num_canonical_nodes, "seed": self.seed, "block_size": self.block_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s epoch; a mid-epoch state visits the samples that epoch has not seen yet.

        Args:
            state: A ``state_dict()`` of a sampler over the same dataset (any number of nodes or ranks).

        Raises:
            ConfigError: The state is of a dataset of another length.
        """
        if state["num_samples"] != self.num_samples_total:
            raise ConfigError(f"the state is of a dataset of {state['num_samples']} samples, this sampler's has "
                              f"{self.num_samples_total}: resume on the same dataset")
        self.epoch = state["epoch"]
        self._resume = None
        if state["seen"] is not None:
            seen = np.unpackbits(np.frombuffer(state["seen"], dtype=np.uint8), count=self.num_samples_total)
            self._resume = (self.epoch, seen.astype(bool))

    def __repr__(self) -> str:
        return (f"NodeStableSampler(node {self.node_rank}/{self.num_nodes}, rank {self.local_rank}/"
                f"{self.local_world_size}, {len(self._shards[self.node_rank])} of {self.num_samples_total} samples, "
                f"canonical={self.num_canonical_nodes}, seed={self.seed}, epoch={self.epoch})")
