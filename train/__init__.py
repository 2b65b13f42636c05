"""GPT-2 in Flax NNX trained with Optax on stable_attn attention (`python -m train`).

Modules: config (named configs), model (GPT-2), attention (the one call into attention), tokenizer
and corpus/data (registry corpora -> nanoGPT .bin, batches), optim, step (jitted step), sharding,
checkpoint (Orbax), monitors (the paper's), metrics, sample, loop (the training loop), cli.
"""
