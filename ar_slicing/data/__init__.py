"""Data: the token store, tokenizers and encoders, Megatron imports and the text readers."""
