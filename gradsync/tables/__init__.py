"""Embedding tables, shared by workers and servers: which modules are served tables and which server holds
which row (`placement`), the row optimizers (`row_optim`), and tables of ids of any int64 value
(`dynamic_embedding`, `dynamic_table`, `id_index`, `id_hash`, `row_init`)."""
