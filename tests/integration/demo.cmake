# demo: the README's main job (scripts/demo.sh) on this build: exit 0, both turns' replies the
# same as the decoder alone's, on the shared route turn 2's line with the first turn's tokens
# cached. demo_shared_route and demo_file_route run it as the README does, on the patched
# llama-server (LLAMA_SERVER_KVSHARE=path, as scripts/test.sh sets it; skipped, exit 77,
# without it: building llama.cpp is the test command's job, not a test's);
# demo_reference_decoder runs it with KVSHARE_DEMO_DECODER=reference.
set(demo_script "${PROJECT_SOURCE_DIR}/scripts/demo.sh")
set(demo_needs_llama "[ -n \"$LLAMA_SERVER_KVSHARE\" ] || { echo 'SKIP: set LLAMA_SERVER_KVSHARE=path of the patched llama-server (scripts/build-llama-server.sh --with-kvshare)'; exit 77; };")
set(demo_same "[ $(echo \"$out\" | grep -c '(the same)') -eq 2 ]")
add_test(NAME demo_shared_route
         COMMAND sh -c "${demo_needs_llama} out=$(KVSHARE_BUILD_DIR='${CMAKE_BINARY_DIR}' '${demo_script}' 2>&1) || { echo \"$out\"; exit 1; }; \
echo \"$out\"; ${demo_same} && echo \"$out\" | grep -q 'prompt tokens, [0-9]* cached: prefill'")
add_test(NAME demo_file_route
         COMMAND sh -c "${demo_needs_llama} out=$(KVSHARE_DEMO_ROUTE=file KVSHARE_BUILD_DIR='${CMAKE_BINARY_DIR}' '${demo_script}' 2>&1) || { echo \"$out\"; exit 1; }; \
echo \"$out\"; ${demo_same} && echo \"$out\" | grep -q 'prompt tokens: prefill .* restore'")
add_test(NAME demo_reference_decoder
         COMMAND sh -c "out=$(KVSHARE_DEMO_DECODER=reference KVSHARE_BUILD_DIR='${CMAKE_BINARY_DIR}' '${demo_script}' 2>&1) || { echo \"$out\"; exit 1; }; \
echo \"$out\"; ${demo_same} && echo \"$out\" | grep -q 'prompt tokens, [0-9]* cached: prefill'")
set_tests_properties(demo_shared_route demo_file_route demo_reference_decoder PROPERTIES TIMEOUT 300)
set_tests_properties(demo_shared_route demo_file_route PROPERTIES SKIP_RETURN_CODE 77)
