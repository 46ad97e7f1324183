"""Communication (installed as ``hetpipe.comm``): the pipeline-boundary channels.

Where things live:

* ``channel`` - the contract every boundary transport keeps (``isend``/``irecv``
  to a global rank, handles with deadlines) and its self-describing header;
* ``factory`` - which channel each boundary rank gets, and every transport's
  constructor; ``stage_link`` - the engine's per-stage view over those channels;
* transports: ``p2p`` (same vendor, torch P2P), ``tcp`` (CPU-forwarding,
  striped; its links and the report naming a stalled one: ``tcp_links``),
  ``direct`` (CPU control plane + a mover: ``shm_mover``, ``ipc_mover``;
  interface in ``mover``), ``gloo`` (reference);
* their shared parts: ``threaded`` (peers, threads, failure, close),
  ``rendezvous`` + ``handshake`` + ``sockets`` (authenticated connections),
  ``staging`` (GPU <-> pinned host copies).
"""
