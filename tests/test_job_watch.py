"""How long a rank stopped by a secondary failure waits for the job's cause (job_watch.grace_for)."""
import pytest

from hetpipe.comm.channel import ChannelTimeout
from hetpipe.comm.tcp_links import LinkStalled
from hetpipe.comm.threaded import PeerLost
from hetpipe.launch.job_watch import grace_for

GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 8000ms for recv operation to complete"
GLOO_CLOSED = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.201.0.2]:41234"


@pytest.mark.parametrize("exc, deadline, grace", [
    (ChannelTimeout("stage 0 timed out after 8 s waiting to receive bwd microbatch 0"), 8.0, 2.0 + 4.0),
    (RuntimeError(GLOO_TIMEOUT), 8.0, 2.0 + 4.0),           # a gloo collective or receive that timed out
    (RuntimeError(GLOO_TIMEOUT), 300.0, 2.0 + 60.0),        # half the deadline, at most a minute
    (RuntimeError(GLOO_CLOSED), 8.0, 2.0),                  # a lost connection names its node already
    (PeerLost("connection to stage 2 lost: the peer closed the connection", 2), 8.0, 2.0),
    (LinkStalled("stage 1 waited 4.8 s for the rest of bwd microbatch 1: link eth1 ...", 2), 8.0, 2.0),
])
def test_a_timeout_waits_half_the_deadline_longer_for_the_cause(exc, deadline, grace):
    """A timeout names nobody, and the rank it waited on may be waiting on the cause itself:
    the channel that can name a node lost behind a dead link does so half the deadline after
    the link closed (tests/test_nic_faults.py checks the whole job's lines)."""
    assert grace_for(exc, deadline) == pytest.approx(grace)
