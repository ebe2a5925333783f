"""Build the sandbox: host packages, a Debian kernel, and a tiny initramfs.

Everything lands in ``emulation/.cache`` and is rebuilt only when an input
changes (the kernel Debian currently ships, the guest init, this file),
so a second ``python -m emulation build`` does nothing.  The kernel is Debian's
own: its CXL, DAX and NVDIMM drivers are modules, so the initramfs carries just
those (and their dependencies) plus a static busybox.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from emulation.errors import SandboxError
from emulation.runner import run
from emulation.sandbox import (
    CACHE,
    GUEST_DIR,
    INITRAMFS,
    KERNEL,
    QEMU,
    STAMP,
    Sandbox,
    accel_override,
)
from emulation.topology import Topology

DEB_DIR = CACHE / "debs"
#: Host packages: the emulator, the guest's shell, and the tools the guest
#: runs from the shared host root (cxl ships in ndctl).
HOST_PACKAGES = ("qemu-system-x86", "busybox-static", "ndctl", "daxctl", "numactl")
BUSYBOX = Path("/bin/busybox")
BOOT_CHECK = Topology("boot-check", cxl_mib=256)
BOOT_CHECK_TIMEOUT_S = 120.0
#: A KVM guest that works boots and runs its script in a few seconds; one that has
#: not after this long is a /dev/kvm that cannot run guests (nested virtualisation).
KVM_CHECK_TIMEOUT_S = 30.0
KERNEL_META = "linux-image-amd64"
#: Modules the guest loads, in this order; dependencies are added before each.
GUEST_MODULES = (
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    "nfit",
    "nd_pmem",
    "cxl_acpi",
    "cxl_port",
    "cxl_pci",
    "cxl_mem",
    "cxl_pmem",
    "device_dax",
    "dax_pmem",
    "dax_hmem",
    "kmem",
)


def build(log: bool = True) -> bool:
    """Make the sandbox ready; True when something was (re)built."""
    say: Callable[[str], None] = print if log else (lambda _: None)
    apt = _Apt(say)
    started = time.monotonic()
    _ensure_packages(apt)
    package = _kernel_package(apt)
    inputs = _inputs_digest(package)
    if _stamp_matches(inputs):
        say(f"the sandbox is up to date ({package}); nothing to do")
        return False
    CACHE.mkdir(exist_ok=True)
    STAMP.unlink(missing_ok=True)  # a half-done rebuild must not pass for a built sandbox
    deb = _download(package, apt)
    release = package.removeprefix("linux-image-")
    with tempfile.TemporaryDirectory(dir=CACHE, prefix="unpack-") as tmp:
        root = Path(tmp)
        say(f"unpacking {deb.name}")
        _run(["dpkg-deb", "-x", str(deb), str(root)])
        _run([str(BUSYBOX), "depmod", "-b", str(root), release])
        shutil.copyfile(root / "boot" / f"vmlinuz-{release}", KERNEL)
        modules = _module_closure(root / "lib" / "modules" / release, GUEST_MODULES)
        _write_initramfs(root / "lib" / "modules" / release, modules, INITRAMFS)
    say(f"kernel {release} and an initramfs of {len(modules)} modules are ready")
    qemu = shutil.which(QEMU)
    if qemu is None:
        raise SandboxError(f"{QEMU} is not on PATH although qemu-system-x86 is installed")
    accel = _pick_accel(Sandbox(qemu, KERNEL, INITRAMFS, release, "tcg"), say)
    STAMP.write_text(
        json.dumps({"inputs": inputs, "kernel_release": release, "accel": accel}, indent=1) + "\n"
    )
    say(f"sandbox built in {time.monotonic() - started:.1f} s")
    return True


def _pick_accel(sandbox: Sandbox, say: Callable[[str], None]) -> str:
    """Boot a guest with a CXL device: with KVM if that really works here, else with TCG.

    /dev/kvm can exist and still fail to boot a guest (nested virtualisation
    that refuses the guest's MSRs), so only a boot tells.  The check also
    proves the kernel, the initramfs and the CXL set-up work together.
    """
    forced = accel_override()
    if forced:
        candidates = [forced]
    elif os.access("/dev/kvm", os.R_OK | os.W_OK):
        candidates = ["kvm", "tcg"]
    else:
        candidates = ["tcg"]
    for accel in candidates:
        trial = replace(sandbox, accel=accel)
        limit = KVM_CHECK_TIMEOUT_S if accel == "kvm" and not forced else BOOT_CHECK_TIMEOUT_S
        result = run(BOOT_CHECK, ["true"], limit, sandbox=trial)
        guest = result.guests[0]
        if result.returncode == 0:
            say(f"boot check: {accel} booted a guest and ran a script in {result.seconds:.1f} s")
            return accel
        why = guest.problem or f"exit code {guest.returncode}"
        say(f"boot check: no guest boots with {accel} here ({why})")
    raise SandboxError(
        f"no guest booted with {' or '.join(candidates)}; read {guest.console} and "
        f"{guest.console.with_name('qemu-0.log')}"
    )


def _run(argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run a build tool; its failure becomes a SandboxError that shows its output."""
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SandboxError(
            f"{' '.join(argv)} failed with exit code {proc.returncode}:\n"
            f"{(proc.stderr or proc.stdout).strip()}"
        )
    return proc.stdout


class _Apt:
    """apt-get, with ``apt-get update`` run at most once and only when needed."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.updated = False
        self.env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}

    def __call__(self, argv: list[str], cwd: Path | None = None) -> str:
        try:
            return _run(argv, cwd, self.env)
        except SandboxError:
            if self.updated:
                raise
        self.say("refreshing the apt package lists (apt-get update)")
        _run(["apt-get", "update"], env=self.env)
        self.updated = True
        return _run(argv, cwd, self.env)


def _ensure_packages(apt: _Apt) -> None:
    """apt-get install whichever host packages are missing."""
    missing = [p for p in HOST_PACKAGES if not _installed(p)]
    if not missing:
        return
    if os.geteuid() != 0:
        raise SandboxError(
            f"missing host packages {', '.join(missing)}; install them with "
            f"'sudo apt-get install {' '.join(missing)}' and run python -m emulation build again"
        )
    apt.say(f"installing {', '.join(missing)}")
    apt(["apt-get", "install", "-y", "--no-install-recommends", *missing])


def _installed(package: str) -> bool:
    proc = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True, check=False
    )
    return proc.returncode == 0 and proc.stdout.endswith(" installed")


def _kernel_package(apt: _Apt) -> str:
    """The linux-image-*-amd64 package that linux-image-amd64 currently depends on."""
    show = apt(["apt-cache", "show", "--no-all-versions", KERNEL_META])
    for line in show.splitlines():
        if line.startswith("Depends:"):
            for dep in line.removeprefix("Depends:").split(","):
                name = dep.split()[0]
                if name.startswith("linux-image-"):
                    return name
    raise SandboxError(f"apt-cache show {KERNEL_META} names no kernel image; check the apt sources")


def _download(package: str, apt: _Apt) -> Path:
    """apt-get download the kernel package into the cache, once per version."""
    DEB_DIR.mkdir(parents=True, exist_ok=True)
    found = sorted(DEB_DIR.glob(f"{package}_*.deb"))
    if found:
        return found[-1]
    apt.say(f"downloading {package}")
    apt(["apt-get", "download", package], cwd=DEB_DIR)
    found = sorted(DEB_DIR.glob(f"{package}_*.deb"))
    if not found:
        raise SandboxError(f"apt-get download {package} left no .deb in {DEB_DIR}")
    for stale in DEB_DIR.glob("*.deb"):
        if stale != found[-1]:
            stale.unlink()
    return found[-1]


def _inputs_digest(package: str) -> str:
    """Everything the built files depend on; a change means a rebuild."""
    h = hashlib.sha256()
    h.update(package.encode())
    h.update("\0".join(GUEST_MODULES).encode())
    h.update((GUEST_DIR / "init").read_bytes())
    h.update(Path(__file__).read_bytes())  # how the initramfs is put together
    h.update(BUSYBOX.read_bytes() if BUSYBOX.exists() else b"")
    return h.hexdigest()


def _stamp_matches(inputs: str) -> bool:
    if not (STAMP.exists() and KERNEL.exists() and INITRAMFS.exists()):
        return False
    try:
        return json.loads(STAMP.read_text()).get("inputs") == inputs
    except ValueError:
        return False


def _module_closure(moddir: Path, wanted: tuple[str, ...]) -> list[str]:
    """Module files (relative to moddir) to insmod, each after its dependencies.

    Modules built into the kernel are skipped; a wanted module the kernel has
    in neither form is an error, since the guest would silently lack a driver.
    """
    deps: dict[str, list[str]] = {}
    for line in (moddir / "modules.dep").read_text().splitlines():
        path, _, rest = line.partition(":")
        deps[path] = rest.split()
    by_name = {_module_name(p): p for p in deps}
    builtin = {_module_name(p) for p in (moddir / "modules.builtin").read_text().split()}
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        for dep in deps[path]:
            visit(dep)
        order.append(path)

    for name in wanted:
        if name in by_name:
            visit(by_name[name])
        elif name not in builtin:
            raise SandboxError(f"the guest kernel has no module {name}; pick another kernel")
    return order


def _module_name(path: str) -> str:
    base = os.path.basename(path)
    return base.split(".ko")[0].replace("-", "_")


def _write_initramfs(moddir: Path, modules: list[str], out: Path) -> None:
    """A gzipped newc cpio: busybox, the init script, the modules and their load order."""
    archive = _Cpio()
    for d in ("bin", "dev", "proc", "sys", "host", "etc", "modules"):
        archive.directory(d)
    archive.file("init", (GUEST_DIR / "init").read_bytes(), 0o755)
    archive.file("bin/busybox", BUSYBOX.read_bytes(), 0o755)
    archive.symlink("bin/sh", "busybox")
    names = []
    for rel in modules:
        name = os.path.basename(rel)
        archive.file(f"modules/{name}", (moddir / rel).read_bytes(), 0o644)
        names.append(name)
    archive.file("etc/modules", ("\n".join(names) + "\n").encode(), 0o644)
    tmp = out.with_suffix(".tmp")
    with gzip.open(tmp, "wb", compresslevel=6) as f:
        f.write(archive.finish())
    tmp.replace(out)


class _Cpio:
    """The newc cpio format the kernel unpacks into its initial root."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes) -> None:
        encoded = name.encode() + b"\0"
        fields = (self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0)
        header = b"070701" + b"".join(b"%08X" % v for v in fields)
        self.parts += [header, encoded, _pad(len(header) + len(encoded)), data, _pad(len(data))]
        self.ino += 1

    def directory(self, name: str) -> None:
        self._entry(name, 0o040755, b"")

    def file(self, name: str, data: bytes, perm: int) -> None:
        self._entry(name, 0o100000 | perm, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, 0o120777, target.encode())

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0, b"")
        return b"".join(self.parts)


def _pad(n: int) -> bytes:
    return b"\0" * (-n % 4)
