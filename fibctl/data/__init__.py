"""Data: recipes -> tokenizer -> uint16 token streams (`prepare`), and the reader API (`streams`).

recipe.py          the TOML data recipe, typed and hashed
sources.py         documents from hub, local, installed-docs and generated sources
installed_docs.py  the offline corpus of installed documentation
generated.py       a deterministic text generator for tests
prepare.py         tokenizer training and streaming tokenization into a data folder
streams.py         `load_manifest`: the manifest whose `stream(split)` training and evaluation read
"""
