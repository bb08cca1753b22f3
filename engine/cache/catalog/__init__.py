"""The catalogue: one SQLite database per cache directory that every process shares.

`tables.py` its rows (files, blocks, claims, leases, pins, in-flight records,
processes), `database.py` connections, transactions and what busy or corrupt
means, `schema.py` the tables and their migrations, `presence.py` this
process's row, heartbeat and keeper thread, `liveness.py` who is alive.
"""
