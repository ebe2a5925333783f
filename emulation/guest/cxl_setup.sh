# Turn the guest's CXL Type-3 device into /dev/dax0.0: one persistent-memory
# region on the device's root decoder, one device-DAX namespace 2 MiB aligned.
# Its data starts 2 MiB into the host's memory file (the namespace info block
# sits before it), identically in every guest that shares the file.
# The tools print JSON on success; it is shown only when a step fails.
step() {
	if ! out=$("$@" 2>&1); then
		echo "$out"
		echo "cxl-setup: '$*' failed; see the console log for kernel messages"
		exit 1
	fi
}
step cxl create-region -t pmem -d decoder0.0 -m mem0 -w 1 -g 256
step ndctl create-namespace -r region0 -m devdax -M mem -a 2M
if [ ! -c /dev/dax0.0 ]; then
	echo "cxl-setup: the namespace was created but /dev/dax0.0 did not appear"
	exit 1
fi
