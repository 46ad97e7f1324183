"""Tokenize text, JSON lines or Parquet into Megatron .bin/.idx files.

Usage mirrors Megatron-LM's tools/preprocess_data.py, e.g.::

    python scripts/preprocess_data.py --input corpus.jsonl --json-keys text \
        --tokenizer /models/llama3-tokenizer --output-prefix data/corpus --workers 8

writes data/corpus_text_document.bin and .idx.
"""

from hetpipe.data.preprocess import main

raise SystemExit(main())
