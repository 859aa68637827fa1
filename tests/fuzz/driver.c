/* driver.c - runs a fuzz target without libFuzzer: every file named on the
 * command line, and every file of every directory named, once through
 * LLVMFuzzerTestOneInput.  This is how the committed corpora (seeds and
 * every input a fuzzer found, tests/fuzz/corpus/<target>/) run as
 * regression tests in the gcc builds, ASan and TSan included; a crash is
 * the test's failure.  With clang, the same targets link libFuzzer instead
 * (tests/fuzz/run.sh). */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path)
{
	FILE *f = fopen(path, "rb");
	uint8_t *buf;
	long n;

	if (!f) {
		perror(path);
		return 1;
	}
	fseek(f, 0, SEEK_END);
	n = ftell(f);
	rewind(f);
	if (n < 0) {
		perror(path);
		fclose(f);
		return 1;
	}
	buf = malloc(n > 0 ? (size_t)n : 1);
	if (!buf || (n > 0 && fread(buf, 1, (size_t)n, f) != (size_t)n)) {
		fprintf(stderr, "%s: read failed\n", path);
		fclose(f);
		free(buf);
		return 1;
	}
	fclose(f);
	LLVMFuzzerTestOneInput(buf, (size_t)n);
	free(buf);
	return 0;
}

int main(int argc, char **argv)
{
	int inputs = 0, bad = 0;

	for (int i = 1; i < argc; i++) {
		struct stat st;
		if (stat(argv[i], &st)) {
			perror(argv[i]);
			return 1;
		}
		if (!S_ISDIR(st.st_mode)) {
			bad |= run_file(argv[i]);
			inputs++;
			continue;
		}
		DIR *d = opendir(argv[i]);
		struct dirent *e;
		while (d && (e = readdir(d))) {
			char p[4096];
			if (e->d_name[0] == '.')
				continue;
			snprintf(p, sizeof(p), "%s/%s", argv[i], e->d_name);
			bad |= run_file(p);
			inputs++;
		}
		if (d)
			closedir(d);
	}
	printf("%d inputs run\n", inputs);
	if (!inputs) {
		fprintf(stderr, "no inputs: name corpus files or directories\n");
		return 1;
	}
	return bad;
}
