"""The facts the engine learns, and how they are written down. Pure, as engine/ is.

types        the events: scheduler actions and transfer outcomes, each with a kind and a version
config       the engine's configuration, which every log header carries; its decision rules (`RULES`)
schema       each kind's field layout, read from its class
codec        an event to a JSON-ready record and back
upcast       older event versions brought forward
packed       tuples of ints or equal-length bytes as one msgpack bin
log_records  the log's header, records and errors, and its JSONL form
log_binary   the binary log: frames, zstd segments, snapshots, the index
keys         how block keys are shown to people
"""
