"""Weight transfer from learner rank 0 to the actors.

Parameters travel in flat buckets of `sync.bucket_mb`, grouped by dtype, in
`named_parameters()` order, which both sides derive from the same architecture
(buckets.py). Rank 0 never waits for actors: `WeightSender.publish` copies the gathered
weights into a free bucket set and a background thread sends it while training goes on
(sender.py). Actors join at their next safe point; a torch engine's parameters are
views of its own buckets (receiver.py).

The actors are not members of the torchrun world, so each membership epoch gets its
own groups, opened by one handshake through a TCPStore that rank 0 hosts
(`transport.store_port`): every member announces itself, rank 0 alone decides "go" or
"abandon", then the groups form (store.py: the store's typed records, the handshake,
and abandoning a broadcast that a dropped member holds up). How the buckets travel is
a transport behind one interface (protocol.py: `TransportSender`, `TransportReceiver`),
chosen by name (transports.py, `sync.transport`), one module each: a pipelined chain on
gloo (gloo_chain.py), one broadcast per bucket on NCCL (nccl.py, on the per-epoch
groups of groups.py), a device-to-device copy for an actor on the learner's own GPU
(cuda_ipc.py), vLLM's weight-transfer API for actors on the vLLM engine (vllm/).
"""
