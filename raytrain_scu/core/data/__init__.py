"""Documents -> token blocks on disk -> deterministic, resumable sharded batches.

    docs = load_documents(source, path)                 # list[str], deterministic order
    data = prepare_data(tokenizer, source=..., path=..., block_size=256, seed=cfg.seed)
    x, y = train_batch(data, position=pos, micro_step=m, rank=r, world_size=w, batch_size=B, seed=cfg.seed)

:mod:`.sources` is the table of data sources, :mod:`.blocks` the split, tokenization and cache, :mod:`.batches`
the training stream and the validation shards. No ray, mlflow or torch.distributed here: every worker calls these
functions with its own rank.
"""
from raytrain_scu.core.data.batches import (
                                            IGNORE_INDEX,
                                            epoch_of,
                                            stream_indices,
                                            train_batch,
                                            val_batches,
                                            val_block_indices,
)
from raytrain_scu.core.data.blocks import (
                                            TokenData,
                                            cache_key,
                                            document_ids,
                                            load_documents,
                                            pack_blocks,
                                            prepare_data,
                                            split_documents,
                                            tokenize_documents,
                                            tokenizer_identity,
)
from raytrain_scu.core.data.sources import SOURCES, Source, check_source, resolve_source, source_files

__all__ = ["IGNORE_INDEX", "SOURCES", "Source", "TokenData", "cache_key", "check_source", "document_ids", "epoch_of",
           "load_documents", "pack_blocks", "prepare_data", "resolve_source", "source_files", "split_documents",
           "stream_indices", "tokenize_documents", "tokenizer_identity", "train_batch", "val_batches",
           "val_block_indices"]
