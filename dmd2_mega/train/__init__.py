"""The training machinery both trainers share: optimizers and gradient buffers (`optim`, `dist_optim`,
`grad_buffer`), checkpoints and their guards (`checkpoint`, `checkpoint_guard`, `run_lock`), offload and
time-slicing (`offload`), resilience and logging (`resilience`, `logger`), the loop (`loop`) and the builders of
models and optimizers (`builders`)."""
