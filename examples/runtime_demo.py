"""The README's Runtime example: one sandbox from the built-in `python` snapshot, two steps, destroyed.

    .venv/bin/python examples/runtime_demo.py       # hi {'a.txt': 'hi'} 2
"""

import asyncio

from rollbox.runtime import ExecRequest, Runtime


async def main() -> None:
    async with Runtime() as rt:
        sb = await rt.create("python", metadata={"episode": "e1"})
        await rt.exec(sb.sandbox_id, ExecRequest(code="open('a.txt', 'w').write('hi')"))
        r = await rt.exec(sb.sandbox_id, ExecRequest(command="cat a.txt", read_files=["a.txt"]))
        usage = await rt.destroy(sb.sandbox_id)  # billed per second
    print(r.stdout, r.files, usage.execs)  # hi {'a.txt': 'hi'} 2


asyncio.run(main())
