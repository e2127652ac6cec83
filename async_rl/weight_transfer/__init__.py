"""Weight sync from learner rank 0 to the actors.

Parameters travel in flat buckets of `sync.bucket_mb`, grouped by dtype, in
`named_parameters()` order, which both sides derive from the same architecture
(plan.py). Rank 0 never waits for actors: `WeightBroadcaster.publish` copies the
gathered weights into a free bucket set (bucket_sets.py) and a background thread sends
it while training goes on (broadcaster.py). Actors join at their next safe point;
their parameters are views of their own buckets (receiver.py).

The actors are not members of the torchrun world, so each membership epoch gets its
own groups, opened by one handshake through a TCPStore that rank 0 hosts
(`transport.store_port`): every member announces itself, rank 0 alone decides "go" or
"abandon", then the groups form (handshake.py, epochs.py; the store's typed records in
records.py). How the buckets then travel is a transport behind one interface
(base.py), chosen by name (transports.py, `sync.transport`): a pipelined chain on gloo
(gloo_chain.py), one broadcast per bucket on NCCL (nccl.py), a device-to-device copy
for an actor on the learner's own GPU (cuda_ipc.py), vLLM's weight-transfer API for
actors on the vLLM engine (vllm.py, vllm_api.py). A broadcast that a dropped member
holds up is abandoned at both ends instead of waiting out its timeout (abandon.py).
"""
