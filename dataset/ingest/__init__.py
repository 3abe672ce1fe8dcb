"""A folder of documents into a clean pretraining corpus (`python -m dataset.ingest`; cli.py says how).

    cli.py        the command: its settings (parse_config) and its report on screen
    pipeline.py   ingest(): read, split, clean, deduplicate, tell the language, hold out, write, report
    walk.py       the files under the folders given        split.py     long documents into records
    language.py   a record's language                      formats/     one reader per format, and their registry
"""
