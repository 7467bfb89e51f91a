# cmake -D BINARY=... -D OUT=... -D RUNNER=... -D TEST_DATA=... -P gtest_suites.cmake
# Run after each build of a GoogleTest binary (qlora_gtest_suites in CMakeLists.txt): writes OUT, which
# ctest includes, with one test per suite of BINARY, named <binary>/<suite> (RUNNER, gtest_suite.sh, runs
# its cases in one process), with QLORA_TEST_DATA=TEST_DATA. A suite's CUDA cases (named so: they skip
# without a GPU) are a test of their own, <binary>/<suite>/cuda, which ctest reports as skipped there
# when any of them skips.
execute_process(COMMAND "${BINARY}" --gtest_list_tests OUTPUT_VARIABLE listing ERROR_VARIABLE errors
                RESULT_VARIABLE rc TIMEOUT 120)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${BINARY} --gtest_list_tests exited ${rc}:\n${listing}${errors}")
endif()
get_filename_component(binary_name "${BINARY}" NAME)
set(cuda "*Cuda*:*cuda*:*CUDA*")  # gtest filter patterns of the CUDA cases' names
set(tests "")
function(add_suite_test name filter)  # [cuda]
  string(APPEND tests "add_test([==[${name}]==] sh [==[${RUNNER}]==] [==[${BINARY}]==] [==[${filter}]==] ${ARGN})\n"
                      "set_tests_properties([==[${name}]==] PROPERTIES SKIP_RETURN_CODE 77\n"
                      "  ENVIRONMENT [==[QLORA_TEST_DATA=${TEST_DATA}]==])\n")
  set(tests "${tests}" PARENT_SCOPE)
endfunction()
function(add_suite)  # the suite read so far: its CPU cases, then its CUDA cases
  if(suite STREQUAL "")
    return()
  endif()
  if(cpu_cases)
    add_suite_test("${binary_name}/${suite}" "${suite}.*-${cuda}")
  endif()
  if(cuda_cases)
    add_suite_test("${binary_name}/${suite}/cuda" "${suite}.*Cuda*:${suite}.*cuda*:${suite}.*CUDA*" cuda)
  endif()
  set(tests "${tests}" PARENT_SCOPE)
endfunction()
string(REPLACE "\n" ";" lines "${listing}")
set(suite "")
foreach(line IN LISTS lines)
  # A suite's line is its name and a dot, unindented ("Nf4Linear.", "Cases/GatedDelta.  # TypeParam ...");
  # its cases' lines follow, indented.
  if(line MATCHES "^([^ #][^ ]*)\\.( .*)?$")
    add_suite()
    set(suite "${CMAKE_MATCH_1}")
    set(cpu_cases FALSE)
    set(cuda_cases FALSE)
  elseif(line MATCHES "^  ([^ ]+)" AND NOT suite STREQUAL "")
    string(TOLOWER "${suite}.${CMAKE_MATCH_1}" case_name)  # the name gtest's filter matches
    if(case_name MATCHES "cuda")
      set(cuda_cases TRUE)
    else()
      set(cpu_cases TRUE)
    endif()
  endif()
endforeach()
add_suite()
file(WRITE "${OUT}" "${tests}")
