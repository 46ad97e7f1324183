"""The open-file limit a job needs: raised where the hard limit allows, else one line and exit 2.

Every rank holds sockets (the store, gloo's pairs, its channels' connections),
pipes and files, and the launcher a connection per store client and pipes per
rank. Under ``ulimit -n`` 32 or 16 the launcher died with a traceback
(``EMFILE`` from a pipe or torch's store server); at 24 it stalled in torch's
rendezvous retries. So each process works out what its part of the job
needs before it starts any of it - the launcher (:func:`launcher_need`) in
:func:`hetpipe.launch.local.launch` and ``python -m hetpipe.launch``, each
rank (:func:`rank_need`) as it starts - and :func:`ensure_fd_limit` raises
the soft limit up to the hard one if that suffices (said at debug level),
or refuses with the limit, the need and the ``ulimit -n`` to run.
"""
from __future__ import annotations

import logging
import math
import resource
from typing import NamedTuple

from hetpipe.devices.cluster import ClusterConfig
from hetpipe.errors import ConfigError

log = logging.getLogger(__name__)

# Descriptors measured on CPU (torch 2.13, tiny_llama, /proc/PID/fd sampled
# every 10 ms over a whole run): the launcher held 42 with two local ranks
# and 56 with four (28, plus 7 a rank: its pipes, its clients' store
# connections); a rank 28 in a job of two ranks (tcp, one stream) and 44 in
# one of four - 12, plus 4 per local rank (the fork server's pipes to its
# other children), 3.5 per rank of the job (gloo's pairs in the world, TP, DP
# and boundary groups) and 2 per connection to a neighbouring stage (one
# stream to each side); four streams added 3, the direct channel's shared
# memory and events 11.
LAUNCHER_BASE, LAUNCHER_PER_RANK = 28, 7
RANK_BASE, RANK_PER_LOCAL, RANK_PER_RANK, RANK_PER_LINK = 12, 4, 3.5, 2
# What a CPU run does not open - a GPU runtime's device files and NCCL's
# sockets, compile workers, a checkpoint's files being written - is not in
# those counts: the need is half as much again.
MARGIN = 1.5
# Where the soft limit is raised to, unless the need is larger: Linux's usual
# soft limit, below which select() (FD_SETSIZE) still works in any library.
_RAISE_TO = 1024


class Need(NamedTuple):
    """Descriptors one process of the job needs, and what they are for (for the line)."""
    count: int
    who: str


def launcher_need(local_ranks: int) -> Need:
    count = math.ceil(MARGIN * (LAUNCHER_BASE + LAUNCHER_PER_RANK * local_ranks))
    return Need(count, f"the launcher of {local_ranks} local rank{'s' * (local_ranks != 1)}")


def rank_need(cluster: ClusterConfig, local_ranks: int) -> Need:
    transport = cluster.transport
    nics = len(transport.interfaces or transport.subnets or transport.addresses or [None])
    links = transport.streams_per_address * nics * (cluster.world_size > 1)
    model = RANK_BASE + RANK_PER_LOCAL * local_ranks + RANK_PER_RANK * cluster.world_size + RANK_PER_LINK * links
    return Need(math.ceil(MARGIN * model), f"each rank of {cluster.world_size} ({links} connection"
                                           f"{'s' * (links != 1)} to each neighbour)")


def ensure_fd_limit(need: Need) -> None:
    """Raise this process's soft RLIMIT_NOFILE to cover ``need`` if the hard limit allows;
    otherwise one line (exit 2) naming the limit, the need and the ``ulimit -n`` to run."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if _at_least(soft, need.count):
        return
    if not _at_least(hard, need.count):
        raise ConfigError(f"the open-file limit is {soft} (hard {hard}) but {need.who} needs about "
                          f"{need.count} descriptors: run with a higher one, e.g. `ulimit -n {need.count}` "
                          f"before the command (above the hard limit only root or limits.conf can)")
    _raise_soft(soft, hard, max(need.count, _RAISE_TO), f"{need.who} needs about {need.count}")


def raise_fd_limit_early(least: Need) -> bool:
    """Before a launcher starts anything (the ranks' fork server inherits its limit): the
    soft limit up to :data:`_RAISE_TO` where the hard one allows. Whether it covers ``least``,
    the need of the smallest launch; the launch itself checks its own need."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if not _at_least(soft, _RAISE_TO):
        _raise_soft(soft, hard, _RAISE_TO, "before the launch")
    return _at_least(hard, least.count)


def _at_least(limit: int, count: int) -> bool:
    return limit == resource.RLIM_INFINITY or limit >= count


def _raise_soft(soft: int, hard: int, target: int, why: str) -> None:
    target = target if hard == resource.RLIM_INFINITY else min(hard, target)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        log.debug("raised the open-file limit from %d to %d (hard %d): %s", soft, target, hard, why)
