"""The reward server: one process that holds the learned reward sources (reward models,
process reward models, local judges) of every `placement: server` component and scores
all actors' samples in dynamic batches, over ZeroMQ with msgpack (`protocol`). The
launcher starts, watches, restarts and stops it like an actor (`process`); the reward's
worker processes reach it through `client`; `batcher` decides what is scored together.
"""
