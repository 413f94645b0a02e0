"""The byte-level vocabulary's ids (tokens 0-255 are bytes, 256 ends a document), without importing megatron-core."""

EOD_ID = 256
BYTE_VOCAB_SIZE = 257  # 256 byte values + EOD
