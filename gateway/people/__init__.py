"""Who is who across channels: linked sender ids sharing one memory (`memory.scope =
"person"`).

- `protocol`: `PeopleStore`, sender id syntax, `person_scope`.
- `store`: the file mode (`FilePeopleStore`, `people.json`).
- `pg_store`: the shared mode (`PostgresPeopleStore`).
- `commands`: `gateway people link|unlink|list`.
"""
