"""transformers models held in a task: the parallel plans they declare themselves, their pipeline
chain, context-parallel attention, sparse MoE blocks, pretrained weights read by slices, and
`fw export --format hf`. transformers is never imported here at module level: a task that holds
one of its models has imported it already."""
