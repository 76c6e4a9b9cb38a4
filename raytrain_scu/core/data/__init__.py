"""Documents or examples -> token blocks or rows on disk -> deterministic, resumable sharded batches.

    docs = load_documents(source, path)                 # list[str], deterministic order
    data = prepare_data(tokenizer, **data_options(cfg))       # config.schema.data_options: every data.* setting
    x, y, pos = train_batch(data, position=pos, micro_step=m, rank=r, world_size=w, batch_size=B, seed=cfg.seed)

:mod:`.sources` is the table of data sources, :mod:`.blocks` the split, tokenization and packing of text into
blocks, :mod:`.examples` and :mod:`.sft` conversations and prompt/completion pairs with their target masks,
:mod:`.packing` their rows, :mod:`.cache` the on-disk cache, :mod:`.batches` the training stream and the validation
shards. No ray, mlflow or torch.distributed here: every worker calls these functions with its own rank.
"""
