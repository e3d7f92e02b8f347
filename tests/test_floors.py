"""docs/design.md's floors hold: every module of kvrescue_local (at its top or inside a function) imports only from
its own room (its folder, or itself) and from rooms on lower floors, so no import runs back up, the rooms of one
floor do not import each other, and the core imports nothing from toy/ or prmtrain/, which stand above it."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvrescue_local"


def floors() -> dict[str, int]:
    """Each room (`name.py` or `name/` of kvrescue_local) and its floor, 1 the top, as docs/design.md's Layout lists them."""
    layout = (ROOT / "docs" / "design.md").read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return {room: int(number) for number, line in re.findall(r"^(\d+)\. (.*)$", layout, flags=re.M)
            for room in re.findall(r"`([^`]+)`", line)}


def room_of(parts: list[str]) -> str:
    """The room of a module given by its path's parts under kvrescue_local: its folder, or its file."""
    return f"{parts[0]}/" if (PACKAGE / parts[0]).is_dir() else f"{parts[0].removesuffix('.py')}.py"


def imported_rooms(path: Path) -> list[tuple[int, str]]:
    """(line, room) for every import of kvrescue_local that the module at `path` makes, relative or absolute."""
    package = list(path.relative_to(ROOT).parent.parts)  # what a relative import of level 1 starts from
    rooms = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = base + (node.module.split(".") if node.module else [])
            # `from kvrescue_local import interrupts` names a module: the room is that module's
            targets = [module + [alias.name] for alias in node.names] if len(module) == 1 else [module]
        else:
            continue
        for target in targets:
            if target[0] == "kvrescue_local" and len(target) > 1:
                name = target[1]
                known = (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").exists()
                rooms.append((node.lineno, room_of([name]) if known else "__init__.py"))
    return rooms


def test_every_room_stands_on_one_floor():
    listed = floors()
    rooms = {room_of(list(p.relative_to(PACKAGE).parts)) for p in PACKAGE.rglob("*.py")}
    assert sorted(rooms - set(listed)) == [], "put each new file or folder on a floor of docs/design.md's Layout"
    assert sorted(set(listed) - rooms) == [], "a floor of docs/design.md's Layout names a room that is gone"


def test_no_import_runs_back_up_or_across_a_floor():
    listed = floors()
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        room = room_of(list(path.relative_to(PACKAGE).parts))
        for line, other in imported_rooms(path):
            if other != room and listed[other] <= listed[room]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({room}, floor {listed[room]}) imports {other} "
                             f"(floor {listed[other]})")
    assert not wrong, "move what is imported down, or the importer up:\n" + "\n".join(wrong)
